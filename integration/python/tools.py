"""Tools through the official `openai` client.

Usage: tools.py BASE_URL MODEL MAX_TOKENS
tool_choice "required" and a named function, whole and streamed: the
calls parse, finish_reason is tool_calls, and each call's arguments parse
as JSON and validate against its tool's schema (the `jsonschema` package);
then a second turn with the assistant's tool_calls message and a `tool`
message, and tool_choice "none". Prints one JSON object.
"""

import json
import sys

from jsonschema import Draft202012Validator
from openai import OpenAI

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def check(calls):
    """Errors of each (name, arguments) call."""
    errors = []
    for name, args in calls:
        if name not in SCHEMAS:
            errors.append(f"unknown function {name}")
            continue
        errors += [e.message for e in Draft202012Validator(SCHEMAS[name]).iter_errors(json.loads(args))]
    return errors


def main() -> None:
    base_url, model, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = {"choices": []}
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        r = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=max_tokens, temperature=0
        )
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in (m.tool_calls or [])]
        ids = [c.id for c in (m.tool_calls or [])]
        streamed, finish = {}, None
        for chunk in client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=max_tokens, temperature=0, stream=True
        ):
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            for d in c.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, ["", ""])
                if d.function.name:
                    entry[0] = d.function.name
                entry[1] += d.function.arguments or ""
            finish = c.finish_reason or finish
        streamed_calls = [tuple(streamed[i]) for i in sorted(streamed)]
        out["choices"].append(
            {
                "choice": choice,
                "calls": calls,
                "ids_ok": all(i.startswith("call_") for i in ids),
                "finish": r.choices[0].finish_reason,
                "errors": check(calls),
                "streamed_calls": streamed_calls,
                "streamed_finish": finish,
                "streamed_errors": check(streamed_calls),
            }
        )

    # A second turn: the call the first answer made, and its result.
    first = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=max_tokens, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    turn = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    r = client.chat.completions.create(model=model, messages=turn, tools=TOOLS, max_tokens=24, temperature=0)
    out["second_turn"] = {"finish": r.choices[0].finish_reason, "has_answer": bool(r.choices[0].message.content or r.choices[0].message.tool_calls)}

    r = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=16, temperature=0
    )
    out["none"] = {"finish": r.choices[0].finish_reason, "tool_calls": r.choices[0].message.tool_calls, "content": r.choices[0].message.content}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
