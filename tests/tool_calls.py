"""Tool calling through the real `openai` client against a running
`flotilla serve`: with `tool_choice` `required` or a named function every
answer is a call of a listed function whose arguments validate against its
parameter schema (`jsonschema`), streamed and not; the streamed call is
the one the client's own accumulation of deltas gives; a round trip (call
-> `tool` message -> answer) is accepted on the next turn, streamed and
not; `parallel_tool_calls: false` gives one call; `auto` answers with text
or valid calls; a bad parameter schema or an unknown function is a 400.

OPENAI_BASE_URL and OPENAI_API_KEY point it at the server. Prints ALL OK
when every check passes; any failed check raises.
"""

import json

import jsonschema
import openai
from openai import OpenAI

client = OpenAI()
model = client.models.list().data[0].id

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 40},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]},
        "strict": True}},
    {"type": "function", "function": {
        "name": "add",
        "description": "Adds two integers.",
        "parameters": {"type": "object",
                       "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                      "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                       "required": ["a", "b"]}}},
]
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]


def check_calls(calls, only=None):
    """Every call names a listed function (or `only`) and its arguments
    validate against that function's parameters; ids are distinct."""
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function", c
        assert c.id and c.id.startswith("call_"), c.id
        name = c.function.name
        assert name in SCHEMA, name
        assert only is None or name == only, (name, only)
        jsonschema.validate(json.loads(c.function.arguments), SCHEMA[name])
    assert len({c.id for c in calls}) == len(calls)


def streamed(**kw):
    """A streamed answer accumulated the way OpenAI's docs show: content
    joined, each call's id/name from its first delta and arguments joined."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# required: every answer is a call, not prose. With parallel calls allowed
# a small model may repeat calls until max_tokens: then every call but a
# last one cut short must be whole and valid.
r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                   tool_choice="required", max_tokens=120, temperature=0)
msg = r.choices[0].message
print("required:", r.choices[0].finish_reason,
      [(c.function.name, c.function.arguments) for c in msg.tool_calls or []])
if r.choices[0].finish_reason == "length":
    whole = [c for c in msg.tool_calls if c.function.arguments.endswith("}")]
    assert len(whole) >= 2, msg
    check_calls(whole)
else:
    assert r.choices[0].finish_reason == "tool_calls", (r.choices[0].finish_reason, msg)
    check_calls(msg.tool_calls)
first = msg

# Streamed, the same calls as the client accumulates them.
content, calls, finish = streamed(model=model, messages=ASK, tools=TOOLS,
                                  tool_choice="required", max_tokens=120, temperature=0)
assert finish == r.choices[0].finish_reason, finish
assert [(c["name"], c["arguments"]) for c in calls] == \
    [(c.function.name, c.function.arguments) for c in first.tool_calls], (calls, first)

# A named function, with sampling: always that function, valid arguments.
for seed in range(3):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Add 2 and 40."}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=80, temperature=0.8, seed=seed)
    check_calls(r.choices[0].message.tool_calls, only="add")

# One call when parallel calls are off, and it ends the answer.
r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=120, temperature=0)
assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
assert len(r.choices[0].message.tool_calls) == 1, r.choices[0].message
check_calls(r.choices[0].message.tool_calls)
first = r.choices[0].message

# The round trip: the call and the tool's answer go back; the next turn is
# accepted and answered, streamed and not.
turn = ASK + [
    first.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
    *[{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}
      for c in first.tool_calls],
]
r = client.chat.completions.create(model=model, messages=turn, tools=TOOLS, tool_choice="none",
                                   max_tokens=40, temperature=0)
assert r.choices[0].finish_reason in ("stop", "length"), r.choices[0]
assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content.strip()
assert not r.choices[0].message.tool_calls
content, calls, finish = streamed(model=model, messages=turn, tools=TOOLS, tool_choice="none",
                                  max_tokens=40, temperature=0)
assert content == r.choices[0].message.content and not calls, (content, calls)
print("round trip answer:", repr(content[:80]))

# auto: text, or calls that are valid.
r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                   max_tokens=60, temperature=0)
m = r.choices[0].message
if m.tool_calls:
    check_calls(m.tool_calls)
    assert r.choices[0].finish_reason == "tool_calls"
else:
    assert m.content, m

# Bad tools are 400s naming the field.
bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
               "properties": {"x": {"type": "string", "pattern": "(["}}}}}]
for kw, param in [
    ({"tools": bad_schema, "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
]:
    try:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=8, **kw)
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == param, (kw, e.body)
    else:
        raise AssertionError(f"accepted: {kw}")

print("ALL OK")
