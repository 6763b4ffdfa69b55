"""A GGUF file quantized by llama.cpp's own quantizer (`llama_model_quantize`, as its `llama-quantize` tool).

    <llama venv>/bin/python -m engine.bench.peers.llama_quantize SRC.gguf DST.gguf q8_0|q4_k_m [--threads N]

Runs under the interpreter of a venv holding llama-cpp-python (the project venv does not). SRC is a bf16 GGUF
(engine/bench/peers/to_gguf.py); DST gets llama.cpp's preset for the type, every tensor included (Q4_K_M: Q4_K
with Q6_K for half of attn_v / ffn_down and the output matrix, as llama.cpp chooses), so that moescope and
llama.cpp can run on one file. Prints the seconds it took; exits non-zero on llama.cpp's failure.
"""

from __future__ import annotations

import argparse
import sys
import time

FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
          "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}


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
    print(f"{a.dst}: {a.type} in {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
