"""A chat with a real instruct model through the official `openai` client.

Usage: real_chat.py BASE_URL MODEL MAX_TOKENS
Prints one JSON object: the model list as the client sees it (with
kvmesh's architecture and quantization fields); a greedy chat answer,
whole and streamed, with its finish reason and usage; a greedy chat with
tools offered (tool_choice auto: whatever the model writes, content or
calls); the same with tool_choice "required" (a call whose arguments must
parse); and a second turn answering that call with a `tool` message.
"""

import json
import sys

from openai import OpenAI

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    }
]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def main() -> None:
    base_url, model, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    out = {}

    m = client.models.list().data[0]
    out["model"] = {"id": m.id, **(m.model_extra or {})}

    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=max_tokens, temperature=0)
    out["chat"] = r.choices[0].message.content
    out["chat_finish"] = r.choices[0].finish_reason
    out["chat_usage"] = [r.usage.prompt_tokens, r.usage.completion_tokens]
    text, finish = "", None
    for chunk in client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=max_tokens, temperature=0, stream=True
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    out["chat_stream"], out["chat_stream_finish"] = text, finish

    r = client.chat.completions.create(
        model=model, messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=max_tokens, temperature=0
    )
    msg = r.choices[0].message
    out["auto"] = {
        "content": msg.content,
        "calls": [[c.function.name, c.function.arguments] for c in (msg.tool_calls or [])],
        "finish": r.choices[0].finish_reason,
    }

    r = client.chat.completions.create(
        model=model, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice="required", max_tokens=max_tokens, temperature=0
    )
    msg = r.choices[0].message
    calls = msg.tool_calls or []
    out["required"] = {
        "calls": [[c.function.name, json.loads(c.function.arguments)] for c in calls],
        "finish": r.choices[0].finish_reason,
    }

    if calls:
        turn = WEATHER_QUESTION + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                    for c in calls
                ],
            }
        ] + [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature_c": 21, "sky": "clear"})} for c in calls]
        r = client.chat.completions.create(model=model, messages=turn, tools=TOOLS, max_tokens=max_tokens, temperature=0)
        out["answer"] = {"content": r.choices[0].message.content, "finish": r.choices[0].finish_reason}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
