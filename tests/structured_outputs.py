"""Structured outputs through the real `openai` client against a running
`flotilla serve`: every 200 answer to a `json_schema` request parses and
validates against its schema (`jsonschema`), over a varied set of schemas
(nested objects, arrays, enums, bounded numbers, required and optional
fields, string patterns); `json_object` mode gives a JSON object; a Pydantic
model round-trips through `client.chat.completions.parse`; a streamed
answer is the same text; a regex (`guided_regex`) is matched whole; a bad
schema is a 400, not a hung or failed stream.

OPENAI_BASE_URL and OPENAI_API_KEY point it at the server. Prints ALL OK
when every check passes; any failed check raises.
"""

import json
import os
import re
import time

import jsonschema
import openai
from openai import OpenAI
from pydantic import BaseModel

client = OpenAI()
model = client.models.list().data[0].id

# The schemas (shared with the mask-time benchmark of crates/grammar).
SCHEMAS = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "json_schemas.json")))
assert len(SCHEMAS) >= 20

ok, long = 0, []
for i, schema in enumerate(SCHEMAS):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give an example value as JSON."}],
        max_tokens=160,
        temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
    )
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "length":
        # Numbers' digits are bounded in the grammar, so no model loops
        # inside one until max_tokens (SmolLM2 and Gemma 3 give 22 of 22
        # here); one answer cut elsewhere (a string a model repeats itself
        # in, on another CPU's rounding) is allowed.
        long.append((i, text[:60]))
        continue
    assert r.choices[0].finish_reason == "stop", (i, r.choices[0].finish_reason, text)
    value = json.loads(text)
    jsonschema.validate(value, schema)
    ok += 1
print(f"json_schema: {ok} of {len(SCHEMAS)} answers complete and valid; cut at max_tokens: {long}")
assert len(long) <= 1, long

# Streamed: the same text as the plain answer.
schema = SCHEMAS[12]
fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
msgs = [{"role": "user", "content": "List two items as JSON."}]
plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=160,
                                       temperature=0, response_format=fmt)
parts = []
for c in client.chat.completions.create(model=model, messages=msgs, max_tokens=160,
                                        temperature=0, response_format=fmt, stream=True):
    for ch in c.choices:
        parts.append(ch.delta.content or "")
assert "".join(parts) == plain.choices[0].message.content, (parts, plain)
jsonschema.validate(json.loads("".join(parts)), schema)
print("stream:", "".join(parts))

# json_object mode: any JSON object.
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Describe a boat in JSON."}],
    max_tokens=120, temperature=0, response_format={"type": "json_object"},
)
if r.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(r.choices[0].message.content), dict), r
print("json_object:", r.choices[0].message.content[:80])


# A Pydantic model through the client's own parse helper.
class Step(BaseModel):
    explanation: str
    output: int


class Answer(BaseModel):
    steps: list[Step]
    final: int


try:
    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Add 2 and 3, step by step."}],
        max_tokens=300, temperature=0, response_format=Answer,
    )
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(r.choices[0].message.parsed, Answer), r
    print("parse:", r.choices[0].message.parsed)
except openai.LengthFinishReasonError:
    # Unbounded strings and lists may run to max_tokens; the client says
    # so rather than parsing half an answer.
    print("parse: stopped at max_tokens")

# A regex (vLLM's guided_regex), on completions.
r = client.completions.create(
    model=model, prompt="The year the first moon landing happened was", max_tokens=8,
    temperature=0, extra_body={"guided_regex": " (19|20)[0-9]{2}"},
)
assert re.fullmatch(r" (19|20)[0-9]{2}", r.choices[0].text), r
assert r.choices[0].finish_reason == "stop", r
print("regex:", repr(r.choices[0].text))

# Bad constraints are 400s naming the problem, quickly.
for fmt, what in [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
     "json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(unclosed"}}}, "json_schema"),
]:
    t0 = time.time()
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format=fmt,
        )
        raise AssertionError(f"bad schema accepted: {fmt}")
    except openai.BadRequestError as e:
        assert what in str(e), e
    assert time.time() - t0 < 10, "a bad schema took long to refuse"
try:
    client.completions.create(model=model, prompt="x", max_tokens=4,
                              extra_body={"guided_regex": "(a"})
    raise AssertionError("bad regex accepted")
except openai.BadRequestError as e:
    assert "regex" in str(e), e

print("ALL OK")
