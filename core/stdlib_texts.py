"""Text from the Python standard library of the running interpreter: code prompts and documentation.

The standard library is always installed, so the code-prompt workload (distribution-shift
experiments: a model trained mostly on chat text, served Python source) and the training corpus
need no download. The library is found with `sysconfig` (falling back to `inspect` on `os`);
files are read in sorted relative-path order, so the output is deterministic for a given
interpreter. Its content differs across Python patch versions: `stdlib_fingerprint()` records which.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import os
import platform
import sysconfig
from pathlib import Path
from typing import Optional

from core.texts import TextPrompt

# Test suites, bundled third-party packages and generated caches are not "the library".
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """Folder of the running interpreter's pure-Python standard library."""
    path = Path(sysconfig.get_paths()["stdlib"])
    if not (path / "os.py").is_file():
        path = Path(inspect.getfile(os)).resolve().parent
    return path


@functools.lru_cache(maxsize=4)
def stdlib_sources(root: Optional[Path] = None) -> tuple[tuple[str, str], ...]:
    """(relative posix path, text) of every UTF-8 `.py` file outside EXCLUDED_DIRS, sorted by path."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS & set(rel.parts[:-1]):
            continue
        try:
            out.append((rel.as_posix(), path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue  # a handful of files use other encodings on purpose; they are not needed
    return tuple(out)


def code_prompts(max_chars: int = 2000, min_chars: int = 200, root: Optional[Path] = None) -> list[TextPrompt]:
    """Python source prompts: each file cut at line boundaries into chunks of at most `max_chars`.

    Chunks shorter than `min_chars` (file tails, tiny files) are dropped; a single line longer than
    `max_chars` is cut. Ids are `<relative path>:<first line>`.
    """
    if min_chars > max_chars or max_chars < 1:
        raise ValueError(f"code_prompts: need 1 <= min_chars <= max_chars, got {min_chars}, {max_chars}")
    prompts = []
    for rel, text in stdlib_sources(root):
        chunk: list[str] = []
        size, start = 0, 1
        for lineno, line in enumerate(text.splitlines(keepends=True), start=1):
            if size + len(line) > max_chars and chunk:
                if size >= min_chars:
                    prompts.append(TextPrompt(f"{rel}:{start}", "".join(chunk)))
                chunk, size, start = [], 0, lineno
            chunk.append(line[:max_chars])
            size += len(chunk[-1])
        if size >= min_chars:
            prompts.append(TextPrompt(f"{rel}:{start}", "".join(chunk)))
    return prompts


def stdlib_docstrings(root: Optional[Path] = None) -> list[TextPrompt]:
    """One document per module: its module, class and function docstrings in source order.

    Modules whose source does not parse with this interpreter, or without docstrings, are skipped.
    """
    return list(_stdlib_docstrings(root))


@functools.lru_cache(maxsize=4)
def _stdlib_docstrings(root: Optional[Path]) -> tuple[TextPrompt, ...]:
    docs = []
    for rel, text in stdlib_sources(root):
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    title = getattr(node, "name", rel)
                    parts.append(f"{title}\n{doc}")
        if parts:
            docs.append(TextPrompt(f"doc:{rel}", "\n\n".join(parts)))
    return tuple(docs)


def pydoc_topics() -> list[TextPrompt]:
    """The Python language-reference topics that ship with `pydoc` (plain text), sorted by topic."""
    from pydoc_data.topics import topics  # a large module: loaded only when the code workload is built

    return [TextPrompt(f"topic:{name}", topics[name]) for name in sorted(topics)]


def stdlib_fingerprint(root: Optional[Path] = None) -> dict[str, object]:
    """Which standard library was read: interpreter version, folder, file count and a content hash."""
    sources = stdlib_sources(root)
    digest = hashlib.sha256()
    for rel, text in sources:
        digest.update(rel.encode())
        digest.update(text.encode())
    return {"python": platform.python_version(), "root": str(Path(root) if root else stdlib_root()),
            "files": len(sources), "sha256": digest.hexdigest()[:16]}
