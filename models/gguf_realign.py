"""`python -m models.gguf_realign in.gguf out.gguf`: rewrite a GGUF file with its tensor data 64-byte aligned.

XLA:CPU aliases a host buffer only at a 64-byte-aligned address (`models.gguf.XLA_ALIAS_ALIGNMENT`), and GGUF
aligns tensor data to `general.alignment`, 32 bytes unless the writer said otherwise. In a released file whose
data section starts 32 bytes off a 64-byte boundary every expert tensor lies off one, so moescope copies all of
them into anonymous memory instead of mapping them (it warns, naming the bytes: `unaliasable_expert_bytes`).
This tool writes the same file with `general.alignment = 64`: every metadata entry byte for byte as it was (the
alignment's value set to 64, or the key added), the tensor infos with the same names, shapes and types and new
offsets, and every tensor's bytes unchanged. llama.cpp reads the result as it read the original.

It streams: headers are parsed from the mapped input (`gguf.GGUFReader`: nothing read but the headers), and
each tensor's bytes are copied through a small buffer, so the rewrite holds a few MiB whatever the file's size
(a 18.6 GB Qwen3-30B-A3B file takes as long as copying 18.6 GB). The output is written to `out.tmp` and renamed
when complete, then parsed again and checked against the input's tensors.

Bad input is a one-line error: a missing or damaged file, a truncated one, a big-endian file, the output the
same path as the input.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path
from typing import Any, Optional

import gguf
import numpy as np

ALIGNMENT = 64  # models.gguf.XLA_ALIAS_ALIGNMENT (kept here so the tool imports no jax)
ALIGNMENT_KEY = "general.alignment"
_COPY_CHUNK = 16 * 2**20


class RealignError(ValueError):
    """A GGUF file this tool cannot rewrite (the message is one line naming the file and the problem)."""


def _pad(n: int, alignment: int) -> int:
    return -n % alignment


def _gguf_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _field_bytes(mapped: np.ndarray, field: Any) -> bytes:
    """A metadata entry or tensor info exactly as the file holds it (key, type and value)."""
    size = sum(int(p.nbytes) for p in field.parts)
    return mapped[field.offset:field.offset + size].tobytes()


def _alignment_entry(alignment: int) -> bytes:
    return _gguf_string(ALIGNMENT_KEY) + struct.pack("<II", int(gguf.GGUFValueType.UINT32), alignment)


def open_input(path: Path) -> gguf.GGUFReader:
    """The input parsed (headers only), or a `RealignError` naming what is wrong with it."""
    if not path.is_file():
        raise RealignError(f"{path}: not found")
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError, IndexError, KeyError ... on damaged bytes
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise RealignError(f"{path}: truncated or not a GGUF file ({size} bytes; {type(exc).__name__}: {first})"
                           ) from None
    if reader.byte_order != "I":
        raise RealignError(f"{path}: a big-endian GGUF file; only little-endian files are rewritten")
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise RealignError(f"{path}: truncated ({size} bytes, its tensors need {end})")
    return reader


def header_bytes(reader: gguf.GGUFReader, alignment: int) -> tuple[bytes, list[int]]:
    """(everything before the data section, padding included; each tensor's offset in the new data section).
    Tensors are laid out in the order of their infos, each at the next multiple of `alignment`."""
    mapped = reader.data
    entries, has_alignment = [], False
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries for the file header (version, counts)
            continue
        if key == ALIGNMENT_KEY:
            entries.append(_alignment_entry(alignment))
            has_alignment = True
        else:
            entries.append(_field_bytes(mapped, field))
    if not has_alignment:
        entries.append(_alignment_entry(alignment))
    infos, offsets, at = [], [], 0
    for t in reader.tensors:
        raw = _field_bytes(mapped, t.field)
        at += _pad(at, alignment)
        offsets.append(at)
        infos.append(raw[:-8] + struct.pack("<Q", at))  # the info ends with its tensor's data offset (uint64)
        at += int(t.n_bytes)
    version = int(reader.fields["GGUF.version"].parts[0][0])
    head = struct.pack("<IIQQ", gguf.GGUF_MAGIC, version, len(reader.tensors), len(entries))
    out = head + b"".join(entries) + b"".join(infos)
    return out + bytes(_pad(len(out), alignment)), offsets


def copy_range(src: Any, dst: Any, start: int, nbytes: int) -> None:
    """`nbytes` of `src` from `start` appended to `dst`, through a buffer of at most `_COPY_CHUNK` bytes."""
    src.seek(start)
    left = nbytes
    while left:
        chunk = src.read(min(left, _COPY_CHUNK))
        if not chunk:
            raise RealignError(f"{src.name}: ended {left} bytes early while copying tensor data")
        dst.write(chunk)
        left -= len(chunk)


def realign(src: str | Path, dst: str | Path, alignment: int = ALIGNMENT) -> dict[str, Any]:
    """Write `dst`: `src` with its tensor data aligned to `alignment` bytes. Returns what was done."""
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise RealignError(f"{dst}: the output must be another file than the input")
    reader = open_input(src)
    field = reader.fields.get(ALIGNMENT_KEY)
    before = int(field.contents()) if field is not None else gguf.GGUF_DEFAULT_ALIGNMENT
    head, offsets = header_bytes(reader, alignment)
    tmp = dst.with_name(dst.name + ".tmp")
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        fout.write(head)
        for t, offset in zip(reader.tensors, offsets):
            fout.write(bytes(len(head) + offset - fout.tell()))
            copy_range(fin, fout, int(t.data_offset), int(t.n_bytes))
    os.replace(tmp, dst)
    check_same_tensors(reader, dst, alignment)
    return {"input": str(src), "output": str(dst), "alignment_before": before, "alignment": alignment,
            "data_offset_before": int(reader.data_offset), "data_offset": len(head), "tensors": len(offsets),
            "bytes": dst.stat().st_size}


def check_same_tensors(reader: gguf.GGUFReader, dst: Path, alignment: int) -> None:
    """The written file parsed again: the input's tensors (names, types, shapes, sizes), every one aligned."""
    out = gguf.GGUFReader(dst, "r")
    want = [(t.name, int(t.tensor_type), t.shape.tolist(), int(t.n_bytes)) for t in reader.tensors]
    got = [(t.name, int(t.tensor_type), t.shape.tolist(), int(t.n_bytes)) for t in out.tensors]
    if got != want:
        raise RealignError(f"{dst}: the written tensors differ from the input's (a bug: please report it)")
    off = [t.name for t in out.tensors if int(t.data_offset) % alignment]
    if off:
        raise RealignError(f"{dst}: tensor {off[0]} is not {alignment}-byte aligned after the rewrite")


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input", type=Path, help="the GGUF file to rewrite")
    ap.add_argument("output", type=Path, help="where to write the realigned file")
    ap.add_argument("--alignment", type=int, default=ALIGNMENT, help="bytes (a power of two; default 64)")
    args = ap.parse_args(argv)
    if args.alignment < 8 or args.alignment & (args.alignment - 1):
        raise SystemExit(f"gguf_realign: --alignment {args.alignment}: must be a power of two, at least 8")
    try:
        done = realign(args.input, args.output, args.alignment)
    except (RealignError, OSError) as exc:
        raise SystemExit(f"gguf_realign: {exc}") from None
    print(f"{done['output']}: {done['tensors']} tensors, data at byte {done['data_offset']} aligned to "
          f"{done['alignment']} (was {done['alignment_before']}, data at byte {done['data_offset_before']}), "
          f"{done['bytes'] / 1e9:.3f} GB", file=sys.stdout)


if __name__ == "__main__":
    main()
