"""Prompt sets in Spec-Bench's JSONL format: one `{"question_id", "category", "turns"}` per line, read by the bench,
`diagnose` and the drafter training data alike. A line may add `"schema"`: a JSON schema its answer must follow
(the bench then generates under that constraint: `constraints`).

The package ships a small set of its own (`bench/data/prompts.jsonl`, 6 "code" and 6 "prose"
prompts); any Spec-Bench `question.jsonl` works the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence

from specdraft.errors import SpecdraftError


@dataclass(frozen=True)
class Prompt:
    """One benchmark question: its id (an int or a string, as in the file), category and turns."""

    question_id: int | str
    category: str
    turns: tuple[str, ...]
    schema: str | None = None  # the JSON schema (as JSON text) its answer must follow, if any


def default_prompts_path() -> Path:
    """The prompt set shipped with the package."""
    return Path(str(resources.files("specdraft.bench") / "data" / "prompts.jsonl"))


def _parse_line(line: str, where: str) -> Prompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise SpecdraftError(f"{where} is not valid JSON: {error.msg}.") from None
    if not isinstance(item, dict):
        raise SpecdraftError(f"{where} must be a JSON object with question_id, category and turns.")
    qid, category, turns = item.get("question_id"), item.get("category"), item.get("turns")
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise SpecdraftError(f"{where}: question_id must be an integer or a string, got {qid!r}.")
    if not isinstance(category, str) or not category:
        raise SpecdraftError(f"{where}: category must be a non-empty string, got {category!r}.")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise SpecdraftError(f"{where}: turns must be a non-empty list of non-empty strings.")
    schema = item.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise SpecdraftError(f"{where}: schema must be a JSON schema (an object), got {type(schema).__name__}.")
    return Prompt(qid, category, tuple(turns), None if schema is None else json.dumps(schema))


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """Read a Spec-Bench style JSONL file (default: the shipped set), in file order.

    Blank lines are skipped; other keys on a line (e.g. Spec-Bench's `reference`) are ignored.
    Raises SpecdraftError on a missing file, a malformed line or a repeated question_id.
    """
    path = Path(path) if path is not None else default_prompts_path()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise SpecdraftError(f"Cannot read the prompts file {path}: {error.strerror or error}.") from None
    prompts: list[Prompt] = []
    seen: set[int | str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        prompt = _parse_line(line, f"{path}, line {number}")
        if prompt.question_id in seen:
            raise SpecdraftError(f"{path}, line {number}: question_id {prompt.question_id!r} appears twice.")
        seen.add(prompt.question_id)
        prompts.append(prompt)
    if not prompts:
        raise SpecdraftError(f"The prompts file {path} has no prompts.")
    return prompts


def load_prompt_files(paths: Sequence[str | Path] | None) -> list[Prompt]:
    """The prompts of several files in order (none given: the shipped set). With more than one
    file, each question_id becomes `"<file stem>:<id>"`, so ids stay unique across files."""
    if not paths:
        return load_prompts(None)
    if len(paths) == 1:
        return load_prompts(paths[0])
    stems = [Path(p).stem for p in paths]
    if len(set(stems)) < len(stems):
        raise SpecdraftError(f"Prompt files need distinct names to tell their questions apart; got {', '.join(stems)}.")
    return [Prompt(f"{stem}:{p.question_id}", p.category, p.turns)
            for stem, path in zip(stems, paths) for p in load_prompts(path)]


def select_prompts(
    prompts: Sequence[Prompt],
    categories: Sequence[str] | None = None,
    max_prompts: int | None = None,
) -> list[Prompt]:
    """Keep the prompts of `categories` (all when None), at most `max_prompts` per category, in file order."""
    available = list(dict.fromkeys(p.category for p in prompts))
    if categories:
        unknown = [c for c in categories if c not in available]
        if unknown:
            raise SpecdraftError(
                f"Unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))}; "
                f"the prompts file has: {', '.join(available)}."
            )
    if max_prompts is not None and max_prompts < 1:
        raise SpecdraftError(f"--max-prompts must be >= 1, got {max_prompts}.")
    wanted = set(categories) if categories else set(available)
    taken: dict[str, int] = {}
    selected = []
    for prompt in prompts:
        if prompt.category not in wanted:
            continue
        if max_prompts is not None and taken.get(prompt.category, 0) >= max_prompts:
            continue
        taken[prompt.category] = taken.get(prompt.category, 0) + 1
        selected.append(prompt)
    return selected
