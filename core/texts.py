"""Shared pieces of the workloads: the error type, a text prompt, tokenizer access, shipped data paths."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

DATA_DIR = Path(__file__).resolve().parents[1] / "engine" / "data"
SHAREGPT_PATH = DATA_DIR / "sharegpt" / "ShareGPT_V3_filtered_500.json"
AZURE_DIR = DATA_DIR / "azure_llm_2023"


class WorkloadFormatError(ValueError):
    """A workload file that does not parse; the message names the file and, where known, the line."""

    def __init__(self, path: str | Path, message: str, line: int | None = None):
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")
        self.path = str(path)
        self.line = line


@dataclass(frozen=True)
class TextPrompt:
    """One prompt of a text workload. `id` is stable across runs (dataset id, or file:line)."""

    id: str
    text: str


class Tokenizer(Protocol):
    """Anything with `encode(text)`: a `tokenizers.Tokenizer` (returns an Encoding with `.ids`) or a
    transformers tokenizer (returns a list of ids)."""

    def encode(self, text: str) -> Any: ...


def encode_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text`, without special tokens, whichever tokenizer flavour is given."""
    try:
        out = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        out = tokenizer.encode(text)
    ids = getattr(out, "ids", out)
    return [int(i) for i in ids]

