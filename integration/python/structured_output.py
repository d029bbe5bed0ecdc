"""Structured output through the official `openai` client.

Usage: structured_output.py BASE_URL MODEL SCHEMAS_JSON MAX_TOKENS
For each JSON schema in SCHEMAS_JSON (a JSON list), a seeded chat
completion with response_format json_schema (strict), whole and streamed,
each answer checked with the `jsonschema` package; then the client's own
`chat.completions.parse` with a Pydantic model, vLLM's structured_outputs
through extra_body, and a schema the server refuses. Prints one JSON object.
"""

import json
import sys
from typing import List, Literal

from jsonschema import Draft202012Validator
from openai import OpenAI
from pydantic import BaseModel, Field


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = Field(max_length=6)
    legs: int = Field(ge=0, le=4)
    tags: List[Literal["old", "new"]] = Field(max_length=2)


def main() -> None:
    base_url, model, schemas, max_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    out = {"schemas": []}

    for schema in schemas:
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, response_format=rf, **seeded
        )
        text = r.choices[0].message.content
        streamed = ""
        for chunk in client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, response_format=rf, stream=True, **seeded
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                streamed += chunk.choices[0].delta.content
        errors = [e.message for e in Draft202012Validator(schema).iter_errors(json.loads(text))]
        out["schemas"].append(
            {"text": text, "streamed": streamed, "finish": r.choices[0].finish_reason, "errors": errors}
        )

    parsed = client.chat.completions.parse(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, response_format=Pet
    )
    pet = parsed.choices[0].message.parsed
    out["parsed"] = pet.model_dump() if pet is not None else None
    out["parsed_errors"] = [
        e.message
        for e in Draft202012Validator(Pet.model_json_schema()).iter_errors(
            json.loads(parsed.choices[0].message.content)
        )
    ]

    r = client.completions.create(
        model=model,
        prompt="Sentiment:",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
    )
    out["choice"] = r.choices[0].text

    try:
        client.chat.completions.create(
            model=model,
            messages=messages,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "integer", "minimum": 3, "maximum": 1}},
            },
        )
        out["refused"] = "accepted"
    except Exception as e:  # openai.BadRequestError
        out["refused"] = f"{type(e).__name__}: {getattr(e, 'param', None)}"

    print(json.dumps(out))


if __name__ == "__main__":
    main()
