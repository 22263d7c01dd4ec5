"""Structured output as clients ask for it: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields, each read into one `StructuredOutput`.

A request carries at most one constraint; two are a 400 naming the second. What the
constraint means is checked where it is compiled (`request_manager/structured.py`, on the
tokenizer thread): a schema, regex or grammar xgrammar refuses is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from adaserve.request_manager.structured import StructuredOutput


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field("response", description="the schema's name (OpenAI requires one)")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # OpenAI's strict: properties outside the schema are never generated. xgrammar always
    # holds output to the schema that way, so both values are served alike.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format` (vLLM takes it on completions too)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"] = Field(
        ..., description="text (no constraint), json_object (any JSON object) or json_schema"
    )
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput.json()
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError(
                'type "json_schema" needs json_schema.schema, e.g. '
                '{"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}'
            )
        return StructuredOutput.json(self.json_schema.schema_)


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = Field(
        False, description="JSON in its compact layout only (no free whitespace)"
    )
    # No fallback backend exists (xgrammar only), and xgrammar never adds properties a schema
    # does not list: both values of these change nothing.
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: Any = None

    @field_validator("whitespace_pattern", "structural_tag")
    @classmethod
    def _unsupported(cls, v: Any, info: Any) -> Any:
        if v is not None:
            raise ValueError(f"{info.field_name} is not supported by adaserve")
        return v

    def constraint(self) -> StructuredOutput | None:
        given = [
            name
            for name, value in (
                ("json", self.json_),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if value is not None
        ]
        if len(given) > 1:
            raise ValueError(
                f"structured_outputs: give one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given)}"
            )
        if not given:
            return None
        so = _constraint(given[0], getattr(self, "json_" if given[0] == "json" else given[0]))
        if self.disable_any_whitespace and so.kind in ("json_object", "json_schema"):
            so = StructuredOutput(so.kind, so.spec, any_whitespace=False)
        return so


# vLLM's older spellings, each one constraint.
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _constraint(kind: str, value: Any) -> StructuredOutput:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"a JSON schema is an object, got {type(value).__name__}")
        return StructuredOutput.json(value)
    if kind == "json_object":
        return StructuredOutput.json()
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise ValueError("a choice is a non-empty list of non-empty strings")
        return StructuredOutput.choice(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"a {kind} is a non-empty string")
    return StructuredOutput.regex(value) if kind == "regex" else StructuredOutput.grammar(value)


def pick_constraint(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputsParams | None,
    guided: dict[str, Any],
) -> tuple[StructuredOutput | None, str | None]:
    """The request's one constraint and the field that carried it; ValueError (message
    starting with the field's name) for two constraints or a malformed one."""
    found: list[tuple[str, StructuredOutput]] = []
    sources: list[tuple[str, Any]] = [
        ("response_format", response_format),
        ("structured_outputs", structured_outputs),
    ]
    for field, source in sources:
        if source is None:
            continue
        try:
            so = source.constraint()
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None
        if so is not None:
            found.append((field, so))
    for field, kind in GUIDED.items():
        if guided.get(field) is not None:
            try:
                found.append((field, _constraint(kind, guided[field])))
            except ValueError as exc:
                raise ValueError(f"{field}: {exc}") from None
    if len(found) > 1:
        raise ValueError(
            f"{found[1][0]}: a request takes one structured output constraint, got "
            f"{' and '.join(f for f, _ in found)}"
        )
    return (found[0][1], found[0][0]) if found else (None, None)
