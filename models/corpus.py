"""Training text of the tiny models, all available offline: ShareGPT prompts and the Python standard library.

Sources (`CorpusSource`):
- `sharegpt`: the 500 shipped ShareGPT prompts, one document each (chat text);
- `stdlib_docs`: per standard-library module its docstrings, plus the language-reference topics
  that ship with `pydoc` (English documentation prose);
- `stdlib_source`: every standard-library `.py` file, one document each (code).

The split into train and validation is by document, on a salted SHA-256 of the document id, so it
is deterministic, independent of document order, and stable when documents are added. `max_chars`
caps each source (documents taken in salted-hash order, not alphabetically) to fit a CPU budget.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

from core.sharegpt import load_sharegpt
from core.stdlib_texts import pydoc_topics, stdlib_docstrings, stdlib_fingerprint, stdlib_sources


class CorpusSource(enum.Enum):
    sharegpt = "sharegpt"
    stdlib_docs = "stdlib_docs"
    stdlib_source = "stdlib_source"


@dataclass(frozen=True)
class CorpusConfig:
    sources: List[CorpusSource] = field(
        default_factory=lambda: [CorpusSource.sharegpt, CorpusSource.stdlib_docs, CorpusSource.stdlib_source])
    validation_fraction: float = 0.05
    max_chars: Optional[int] = None  # per source, at most (whole documents); None: everything
    salt: str = "moescope-corpus-v1"


@dataclass(frozen=True)
class Document:
    id: str  # unique over the corpus: "<source>/<id within the source>"
    source: CorpusSource
    text: str


def _hash01(salt: str, key: str) -> float:
    digest = hashlib.sha256(f"{salt}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def source_documents(source: CorpusSource) -> list[Document]:
    """All documents of one source, in a fixed order."""
    if source is CorpusSource.sharegpt:
        items = [(p.id, p.text) for p in load_sharegpt()]
    elif source is CorpusSource.stdlib_docs:
        items = [(p.id, p.text) for p in stdlib_docstrings() + pydoc_topics()]
    elif source is CorpusSource.stdlib_source:
        items = list(stdlib_sources())
    else:  # pragma: no cover - enum is closed
        raise ValueError(f"corpus source {source!r}")
    return [Document(f"{source.value}/{key}", source, text) for key, text in items if text.strip()]


def cap_documents(docs: list[Document], max_chars: Optional[int], salt: str) -> list[Document]:
    """Whole documents in salted-hash order until `max_chars` characters (None: all, original order)."""
    if max_chars is None:
        return docs
    if max_chars < 1:
        raise ValueError(f"corpus.max_chars: must be >= 1, got {max_chars}")
    kept, total = [], 0
    for doc in sorted(docs, key=lambda d: _hash01(salt + "/cap", d.id)):
        if total + len(doc.text) > max_chars and kept:
            continue
        kept.append(doc)
        total += len(doc.text)
    order = {d.id: i for i, d in enumerate(docs)}
    return sorted(kept, key=lambda d: order[d.id])


def split_documents(docs: list[Document], validation_fraction: float, salt: str
                    ) -> tuple[list[Document], list[Document]]:
    """(train, validation) by salted hash of each document id; order within each split is kept."""
    if not 0 <= validation_fraction < 1:
        raise ValueError(f"corpus.validation_fraction: must be in [0, 1), got {validation_fraction}")
    val = [d for d in docs if _hash01(salt, d.id) < validation_fraction]
    train = [d for d in docs if _hash01(salt, d.id) >= validation_fraction]
    return train, val


@dataclass(frozen=True)
class Corpus:
    config: CorpusConfig
    train: tuple[Document, ...]
    validation: tuple[Document, ...]

    def texts(self, split: str = "train") -> Iterator[str]:
        docs = {"train": self.train, "validation": self.validation}.get(split)
        if docs is None:
            raise ValueError(f"corpus split {split!r}: expected 'train' or 'validation'")
        return (d.text for d in docs)

    def stats(self) -> dict[str, object]:
        """Documents and characters per split and source, and which standard library was read."""
        out: dict[str, object] = {}
        for split, docs in (("train", self.train), ("validation", self.validation)):
            per: dict[str, dict[str, int]] = {}
            for d in docs:
                s = per.setdefault(d.source.value, {"documents": 0, "chars": 0})
                s["documents"] += 1
                s["chars"] += len(d.text)
            out[split] = per
        if any(s is not CorpusSource.sharegpt for s in self.config.sources):
            out["stdlib"] = stdlib_fingerprint()
        return out


def build_corpus(config: CorpusConfig = CorpusConfig()) -> Corpus:
    """Load, cap and split the configured sources (deterministic for a given Python installation)."""
    if not config.sources:
        raise ValueError("corpus.sources: empty")
    docs: list[Document] = []
    for source in dict.fromkeys(config.sources):
        docs.extend(cap_documents(source_documents(source), config.max_chars, config.salt))
    train, val = split_documents(docs, config.validation_fraction, config.salt)
    if not train:
        raise ValueError("corpus: the training split is empty")
    return Corpus(config, tuple(train), tuple(val))
