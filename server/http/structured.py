"""Structured output on the HTTP API: OpenAI's ``response_format`` and vLLM's ``guided_*``
extra fields -> the service's ``StructuredOutput``.

- ``response_format: {"type": "json_object"}``: any JSON object.
- ``response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``:
  the output follows the schema. Decoding is always constrained, so ``strict: false`` gives
  the same guarantee as ``strict: true``.
- ``guided_json`` (a schema, as an object or JSON text), ``guided_regex``, ``guided_choice``
  (a list of strings), ``guided_grammar`` (EBNF in xgrammar's GBNF dialect), as vLLM names
  them in ``extra_body``.

At most one of these per request; a grammar that does not compile answers 400 as well (the
engine's ``structured.*`` error, through the service's ``INVALID_ARGUMENT``).
"""

from __future__ import annotations

import json
from typing import Any

from loraplex.server.params import StructuredOutput

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})


class StructuredError(ValueError):
    """A structured-output parameter the API refuses; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_output(response_format: dict[str, Any] | None, guided_json: Any = None,
                      guided_regex: str | None = None, guided_choice: list[str] | None = None,
                      guided_grammar: str | None = None) -> StructuredOutput | None:
    """The one constraint a body asks for (None: free text).

    Raises:
        StructuredError: naming the parameter (two constraints at once, an unknown
            ``response_format.type``, a schema that is not a JSON object, bounds).
    """
    given: list[tuple[str, StructuredOutput]] = []
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            given.append(("response_format", spec))
    if guided_json is not None:
        text = guided_json if isinstance(guided_json, str) else json.dumps(guided_json)
        given.append(("guided_json", _build("guided_json", "json_schema", text)))
    if guided_regex is not None:
        given.append(("guided_regex", _build("guided_regex", "regex", guided_regex)))
    if guided_choice is not None:
        given.append(("guided_choice", _build("guided_choice", "choice",
                                              choices=tuple(guided_choice))))
    if guided_grammar is not None:
        given.append(("guided_grammar", _build("guided_grammar", "grammar", guided_grammar)))
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise StructuredError(f"{given[1][0]}: give one constraint, not {names}",
                              given[1][0])
    return given[0][1] if given else None


def _response_format(doc: dict[str, Any]) -> StructuredOutput | None:
    kind = doc.get("type")
    if kind not in RESPONSE_FORMATS:
        raise StructuredError(f"response_format.type: {json.dumps(kind)[:64]} is not one of "
                              f"{', '.join(RESPONSE_FORMATS)}", "response_format.type")
    extra = set(doc) - {"type", "json_schema"}
    if extra or (kind != "json_schema" and "json_schema" in doc):
        name = sorted(extra)[0] if extra else "json_schema"
        raise StructuredError(f"response_format.{name}: unexpected for type {kind}",
                              f"response_format.{name}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    spec = doc.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredError("response_format.json_schema: must be an object with name and "
                              "schema", "response_format.json_schema")
    unknown = set(spec) - JSON_SCHEMA_KEYS
    if unknown:
        raise StructuredError(f"response_format.json_schema.{sorted(unknown)[0]}: unexpected",
                              "response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise StructuredError("response_format.json_schema.name: required (a string)",
                              "response_format.json_schema.name")
    if not isinstance(spec.get("strict", False), bool):
        raise StructuredError("response_format.json_schema.strict: must be a boolean",
                              "response_format.json_schema.strict")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise StructuredError("response_format.json_schema.schema: must be an object",
                              "response_format.json_schema.schema")
    return _build("response_format.json_schema.schema", "json_schema", json.dumps(schema))


def _build(param: str, kind: str, value: str = "",
           choices: tuple[str, ...] = ()) -> StructuredOutput:
    if kind == "choice" and not all(isinstance(c, str) for c in choices):
        raise StructuredError(f"{param}: must be a list of strings", param)
    try:
        return StructuredOutput(kind, value, choices)
    except ValueError as exc:
        # StructuredOutput's message names "structured.<kind>"; the body's name is the param.
        detail = str(exc).split(": ", 1)[-1]
        raise StructuredError(f"{param}: {detail}", param) from None
