"""``response_format`` and vLLM's ``guided_*`` fields -> ``StructuredOutput`` (no server)."""

from __future__ import annotations

import json

import pytest

from loraplex.server.http.schema import BadRequest, chat_request, completion_requests
from loraplex.server.params import StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
DEEP: dict = {}
for _ in range(40):  # a schema nested past MAX_SCHEMA_DEPTH (the body's own bound is later)
    DEEP = {"items": DEEP}


def chat(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    return chat_request(body, 16)[1].params.structured


def test_response_formats() -> None:
    assert chat() is None
    assert chat(response_format={"type": "text"}) is None
    assert chat(response_format={"type": "json_object"}) == StructuredOutput("json_object")
    for strict in (True, False):
        got = chat(response_format={"type": "json_schema", "json_schema": {
            "name": "thing", "schema": SCHEMA, "strict": strict}})
        assert got is not None and got.kind == "json_schema"
        assert json.loads(got.value) == SCHEMA


def test_guided_fields_on_both_endpoints() -> None:
    assert chat(guided_json=SCHEMA) == StructuredOutput("json_schema", json.dumps(SCHEMA))
    assert chat(guided_json=json.dumps(SCHEMA)).kind == "json_schema"
    assert chat(guided_regex="[a-z]+") == StructuredOutput("regex", "[a-z]+")
    assert chat(guided_choice=["yes", "no"]) == StructuredOutput("choice",
                                                                 choices=("yes", "no"))
    assert chat(guided_grammar='root ::= "a"') == StructuredOutput("grammar", 'root ::= "a"')
    _, requests = completion_requests({"model": "m", "prompt": ["p", "q"],
                                       "guided_regex": "[0-9]{3}"})
    assert [r.params.structured for r in requests] == [StructuredOutput("regex",
                                                                        "[0-9]{3}")] * 2


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"], "guided_grammar": "root ::= \"a\""}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n",
                                                                 "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n",
                                                                 "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_object", "json_schema": {}}},
     "response_format.json_schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": "a" * (70 << 10)}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": DEEP}, "guided_json"),
])
def test_refusals_name_the_parameter(fields: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        chat(**fields)
    assert info.value.param == param and str(info.value).startswith(param), info.value
