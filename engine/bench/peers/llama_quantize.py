"""A GGUF file quantized by llama.cpp's own quantizer (`llama_model_quantize`, as its `llama-quantize` tool).

    <llama venv>/bin/python -m engine.bench.peers.llama_quantize SRC.gguf DST.gguf q8_0|q4_k_m [--threads N]

Runs under the interpreter of a venv holding llama-cpp-python (the project venv does not). SRC is a bf16 GGUF
(engine/bench/peers/to_gguf.py); DST gets llama.cpp's preset for the type, every tensor included (Q4_K_M: Q4_K
with Q6_K for half of attn_v / ffn_down and the output matrix, as llama.cpp chooses), so that moescope and
llama.cpp can run on one file. Prints the seconds it took; exits non-zero on llama.cpp's failure.

llama.cpp's quantizer copies the source's metadata, `general.alignment` included, but lays its output out at its
own default alignment (32). From a source written at 64 (peers/to_gguf.py) its file declares 64 while its data
section starts at the 32-byte boundary, so every reader (llama.cpp's own loader too: "data is not within the file
bounds") looks 32 bytes past each tensor. `repair_alignment` sets the declared value to the one the data was laid
out at, in place (the same bytes otherwise), and refuses a file that fits neither.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import gguf
import numpy as np

LLAMA_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT: what llama.cpp's quantizer lays its output out at
ALIGNMENT_KEY = "general.alignment"

FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
          "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}


class _Header(gguf.GGUFReader):
    """A GGUF file's metadata and tensor infos, no tensor views (a misaligned file cannot build them). Overrides the
    reader's last construction step, `_build_tensors` (gguf 0.19, the pinned version)."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        self.tensor_fields = fields


def _data_bytes(fields: list) -> int:
    """Bytes the tensors reach past the data section's start (the last tensor's offset plus its size)."""
    end = 0
    for f in fields:
        _, _, _, dims, raw_type, offset = f.parts
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
        end = max(end, int(offset[0]) + int(np.prod(dims)) * size // block)
    return end


def repair_alignment(path: str | Path) -> int | None:
    """Make `path`'s declared alignment the one its data was laid out at; returns the old value where it changed."""
    head = _Header(path)
    field = head.fields.get(ALIGNMENT_KEY)
    if field is None:
        return None
    declared = int(field.parts[-1][0])
    if not head.tensor_fields:
        return None
    last = head.tensor_fields[-1]  # the data section starts at the end of the tensor infos, padded
    infos_end = int(last.offset) + sum(int(p.nbytes) for p in last.parts)
    need, size = _data_bytes(head.tensor_fields), os.path.getsize(path)

    def start(alignment: int) -> int:
        return infos_end + (-infos_end % alignment)

    if start(declared) + need <= size:
        return None
    if start(LLAMA_ALIGNMENT) + need > size:
        raise SystemExit(f"{path}: truncated: its tensors need {start(LLAMA_ALIGNMENT) + need} bytes, the file has {size}")
    value_at = int(field.offset) + sum(int(p.nbytes) for p in field.parts[:-1])
    del head
    with open(path, "r+b") as f:
        f.seek(value_at)
        f.write(np.uint32(LLAMA_ALIGNMENT).tobytes())
    return declared


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("type", choices=sorted(FTYPES))
    ap.add_argument("--threads", type=int, default=0, help="quantizer threads (0: llama.cpp's default)")
    a = ap.parse_args(argv)
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[a.type])
    params.nthread = a.threads
    t = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(a.src.encode(), a.dst.encode(), params)
    if rc != 0:
        print(f"llama_model_quantize {a.src} -> {a.dst} ({a.type}) failed: return code {rc}", file=sys.stderr)
        return 1
    old = repair_alignment(a.dst)
    if old is not None:
        print(f"{a.dst}: general.alignment {old} -> {LLAMA_ALIGNMENT} (the alignment llama.cpp laid the data out at)")
    print(f"{a.dst}: {a.type} in {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
