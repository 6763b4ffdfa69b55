"""ShareGPT prompts: the first human turn of each conversation, validated record by record.

File format (the ShareGPT dumps): a JSON list of records
`{"id": str, "conversations": [{"from": "human" | "gpt" | ..., "value": str}, ...]}`.
The prompt of a record is its first turn whose `from` is `human` (or `user`). A record that is not
an object, lacks `id` / `conversations`, or has no human turn raises `WorkloadFormatError` naming the
file, line and column where the record starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from core.texts import SHAREGPT_PATH, TextPrompt, WorkloadFormatError

_HUMAN = ("human", "user")


def _line_col(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def iter_json_array(text: str, path: str | Path) -> Iterator[tuple[int, int, int, Any]]:
    """(index, line, column, value) of every element of a top-level JSON array, with positions."""
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        raise WorkloadFormatError(path, "expected a JSON list of records", 1)
    pos += 1
    index = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if text.startswith("]", pos):
            return
        line, col = _line_col(text, pos)
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise WorkloadFormatError(path, f"column {exc.colno}: invalid JSON: {exc.msg}", exc.lineno) from None
        yield index, line, col, value
        index += 1
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if text.startswith(",", pos):
            pos += 1
        elif not text.startswith("]", pos):
            line, col = _line_col(text, pos)
            raise WorkloadFormatError(path, f"column {col}: expected ',' or ']' after record {index - 1}", line)


def load_sharegpt(path: str | Path = SHAREGPT_PATH) -> list[TextPrompt]:
    """The prompts of a ShareGPT file, in file order (the shipped 500 prompts by default)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadFormatError(path, f"cannot read: {exc}") from None
    prompts: list[TextPrompt] = []
    seen: set[str] = set()
    for index, line, col, rec in iter_json_array(text, path):
        def bad(msg: str) -> WorkloadFormatError:
            return WorkloadFormatError(path, f"column {col}: record {index}: {msg}", line)

        if not isinstance(rec, dict):
            raise bad(f"expected an object, got {type(rec).__name__}")
        rid, turns = rec.get("id"), rec.get("conversations")
        if not isinstance(rid, str) or not rid:
            raise bad("missing string field 'id'")
        if rid in seen:
            raise bad(f"duplicate id {rid!r}")
        if not isinstance(turns, list):
            raise bad(f"(id {rid}) missing list field 'conversations'")
        human = next((t for t in turns if isinstance(t, dict) and t.get("from") in _HUMAN), None)
        if human is None:
            raise bad(f"(id {rid}) has no human turn")
        value = human.get("value")
        if not isinstance(value, str) or not value.strip():
            raise bad(f"(id {rid}) human turn has no text 'value'")
        seen.add(rid)
        prompts.append(TextPrompt(id=rid, text=value))
    if not prompts:
        raise WorkloadFormatError(path, "no records")
    return prompts
