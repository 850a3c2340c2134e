"""`response_format` on the live server (one request at a time, and batched): answers match the schema, regex or
grammar asked for, streamed or not; a constraint that is wrong is a 400 naming `response_format`."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from live_server import Live, make_app
from test_constraints import LIST_REGEX, SCHEMA

MODEL = "target"


@pytest.fixture(scope="module", params=[1, 4], ids=["alone", "batched"])
def live(request, tiny_model_dirs):
    with Live(make_app(tiny_model_dirs, max_batch=request.param, max_tokens=64)) as server:
        yield server


def test_a_json_schema_answer_is_valid_streamed_or_not(live):
    client = live.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "A record, please."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, response_format=response_format)
    answer = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert 0 < chat.usage.model_extra["forced_tokens"] < chat.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=True,
                                                 response_format=response_format))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    sampled = client.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, seed=3, n=2,
                                             response_format=response_format)
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_regex_and_grammar_answers_on_both_endpoints(live):
    client = live.client()
    text = client.completions.create(model=MODEL, prompt="Answer:", temperature=0,
                                     extra_body={"response_format": {"type": "regex", "regex": LIST_REGEX}})
    assert re.fullmatch(LIST_REGEX, text.choices[0].text)
    grammar = 'start: "answer: " choice\nchoice: "left" | "right"\n'
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Which way?"}],
                                          temperature=0, extra_body={"response_format": {"type": "grammar",
                                                                                         "grammar": grammar}})
    assert chat.choices[0].message.content in ("answer: left", "answer: right")


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}, "Invalid type"),
    ({"type": "json_schema"}, "needs its json_schema field"),
    ({"type": "regex", "regex": "a(b"}, "regex is not valid"),
    ({"type": "grammar", "grammar": "start: nowhere\n"}, "grammar is not valid"),
    ({"type": "text", "regex": "a"}, "takes no regex"),
    ({"type": "json_object", "grammar": "start: \"a\"\n"}, "takes no grammar"),
])
def test_a_wrong_constraint_is_a_400_naming_it(live, response_format, message):
    reply = httpx.post(f"{live.url}/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "response_format": response_format})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == "response_format"


def test_logprobs_under_a_constraint_cover_every_token(live):
    """With logprobs every token is scored (none is forced past a pass), so each has its log-probability."""
    client = live.client()
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A record."}], temperature=0, logprobs=True,
        top_logprobs=2, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens  # the answer's tokens, its closing EOS included
    assert "".join(item.token for item in content).removesuffix("<|im_end|>") == chat.choices[0].message.content
    assert all(item.logprob <= 0 and len(item.top_logprobs) == 2 for item in content)
