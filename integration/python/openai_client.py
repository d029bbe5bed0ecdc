"""Drives a kvmesh gateway with the official `openai` client.

Usage: openai_client.py BASE_URL MODEL PROMPT MAX_TOKENS
Prints one JSON object: the text of a completion and of a chat completion,
each non-streamed and streamed (greedy), with finish reasons and usage.
"""

import json
import sys

from openai import OpenAI


def main() -> None:
    base_url, model, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    out = {}

    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    out["completion"] = r.choices[0].text
    out["completion_finish"] = r.choices[0].finish_reason
    out["completion_usage"] = [r.usage.prompt_tokens, r.usage.completion_tokens]

    text = ""
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True):
        if chunk.choices:
            text += chunk.choices[0].text or ""
    out["completion_stream"] = text

    messages = [{"role": "user", "content": prompt}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    out["chat"] = r.choices[0].message.content
    out["chat_role"] = r.choices[0].message.role
    out["chat_finish"] = r.choices[0].finish_reason

    text = ""
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    out["chat_stream"] = text

    models = client.models.list()
    out["models"] = [m.id for m in models.data]

    try:
        client.completions.create(model=model, prompt=prompt, max_tokens=100000)
        out["over_length"] = "accepted"
    except Exception as e:  # openai.BadRequestError
        out["over_length"] = f"{type(e).__name__}: {getattr(e, 'code', None)}"

    print(json.dumps(out))


if __name__ == "__main__":
    main()
