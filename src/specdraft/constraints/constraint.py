"""What an answer must match, as the user gave it, and its grammar in llguidance's terms."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError

# json_schema: a JSON schema (an object); json_object: any JSON object; regex: the whole answer matches it;
# grammar: a context-free grammar in Lark or GBNF (llama.cpp's) syntax.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar")
# How JSON answers are laid out, unless a schema has an "x-guidance" key (llguidance's JSON options, then taken as
# they are): as the model likes to write them (pretty-printed, say), but between two tokens of JSON at most one
# space, or a newline and an indent of up to 32 spaces. Measured on the bundled pair (docs/structured-output.md):
# with free whitespace the target ran to the budget in spaces on 2 of 24 schema prompts; with none (compact JSON) it
# kept adding keys to "any JSON object" until the budget; bounded, every answer ended and was valid.
JSON_LAYOUT = {"whitespace_flexible": True, "whitespace_pattern": r"(?: |\n {0,32})?"}


@dataclass(frozen=True)
class Constraint:
    """A constraint on the answer: its `kind` (CONSTRAINT_KINDS) and `text` (the schema as JSON, the regex or the
    grammar; empty for json_object). Build one with the named constructors, which check the text's form."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise SpecdraftError(f"Unknown constraint kind {self.kind!r}; choose from: {', '.join(CONSTRAINT_KINDS)}.")
        if self.kind != "json_object" and not self.text.strip():
            raise SpecdraftError(f"The {self.label} is empty; give one.")

    @property
    def label(self) -> str:
        """How messages name it."""
        return {"json_schema": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
                "grammar": "grammar"}[self.kind]

    @staticmethod
    def json_schema(schema: dict | str) -> "Constraint":
        """Answers valid under this JSON schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise SpecdraftError(f"The JSON schema is not valid JSON: {error}.") from None
        if not isinstance(schema, dict):
            raise SpecdraftError(f"A JSON schema must be a JSON object, got {type(schema).__name__}.")
        return Constraint("json_schema", json.dumps(schema))

    @staticmethod
    def json_object() -> "Constraint":
        """Any JSON object."""
        return Constraint("json_object")

    @staticmethod
    def regex(pattern: str) -> "Constraint":
        """Answers this regex matches whole (Rust `regex` syntax)."""
        return Constraint("regex", pattern)

    @staticmethod
    def grammar(text: str) -> "Constraint":
        """Answers of this context-free grammar, in Lark or GBNF syntax."""
        return Constraint("grammar", text)

    @staticmethod
    def from_options(json_schema: str | Path | None = None, regex: str | None = None,
                     grammar: str | Path | None = None, json_object: bool = False) -> "Constraint | None":
        """The constraint of `specdraft generate`'s options (files for the schema and the grammar); None without
        one. More than one is an error."""
        given = [name for name, value in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar),
                                          ("--json-object", json_object or None)) if value is not None]
        if len(given) > 1:
            raise SpecdraftError(f"Give one constraint, not {' and '.join(given)}.")
        if json_schema is not None:
            return Constraint.json_schema(_read(json_schema, "--json-schema"))
        if grammar is not None:
            return Constraint.grammar(_read(grammar, "--grammar"))
        if regex is not None:
            return Constraint.regex(regex)
        return Constraint.json_object() if json_object else None

    def validates(self, text: str) -> bool | None:
        """Whether `text` is a valid answer, by a validator independent of the masks (a JSON schema: `jsonschema`;
        any JSON object: the JSON parser); None for a regex or a grammar (not checked here)."""
        if self.kind not in ("json_schema", "json_object"):
            return None
        import jsonschema

        try:
            value = json.loads(text)
            if self.kind == "json_schema":
                jsonschema.validate(value, json.loads(self.text))
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return self.kind == "json_schema" or isinstance(value, dict)

    def check(self) -> str:
        """This constraint as an llguidance grammar, checked without a tokenizer (what can be known before a model
        loads; `grammar_state.check_constraint` checks it against one): an error names what is wrong."""
        from llguidance import LLMatcher

        grammar = self.grammar_text()
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            raise SpecdraftError(f"The {self.label} is not valid: {messages[0].strip()}")
        return grammar

    def grammar_text(self) -> str:
        """This constraint as an llguidance grammar, unchecked (`check` checks it)."""
        import llguidance
        from llguidance import LLMatcher

        try:
            if self.kind == "json_schema":
                own = "x-guidance" in json.loads(self.text)  # llguidance's options, as the schema gives them
                return LLMatcher.grammar_from_json_schema(self.text, defaults=None if own else JSON_LAYOUT)
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.text)
            return llguidance.grammar_from("grammar", self.text)
        except ValueError as error:
            raise SpecdraftError(f"The {self.label} is not valid: {error}") from None


def _read(path: str | Path, option: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise SpecdraftError(f"{option}: cannot read {path}: {error.strerror or error}.") from None
