"""Error of the block-type kernels' two roundings against the exact product, on the same random shapes.

    python -m engine.bench.bench_block_rounding
    python -m engine.bench.bench_block_rounding --rows 64 --cols 4096 --out 512 --types q8_0,q4_k

The vector paths (AVX512-VNNI, AVX2, scalar) quantize the activations to Q8_0 / Q8_K as llama.cpp does and use the
weights exactly; the AMX path (calls of enough rows, `models.native.block_rounding`) rounds the dequantized weights
and the activations to bf16. For each type, random ggml blocks and two kinds of activations (standard normal, and
Student-t with 3 degrees of freedom: heavy tails, as LLM activations have), each kernel's output is compared with
the f64 product of the f32 activations and the dequantized weights ("exact"): RMS and max |error| over the RMS of
the exact outputs, and their ratio (AMX / vector). Runs the library's own kernels (the vector path forced with
`set_isa("avx512bf16")`, else the best non-AMX one); needs AMX for the second column. Prints; asserts nothing.
"""

from __future__ import annotations

import argparse

import numpy as np

from models import native


def errors(y: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    """(RMS, max) |y - exact| over the RMS of exact."""
    scale = float(np.sqrt(np.mean(exact**2)))
    d = np.abs(y.astype(np.float64) - exact)
    return float(np.sqrt(np.mean(d**2))) / scale, float(d.max()) / scale


def activations(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal((rows, cols)).astype(np.float32)
    return rng.standard_t(3, (rows, cols)).astype(np.float32)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(native.QTYPE_IDS))
    ap.add_argument("--rows", type=int, default=64, help="activation rows (m)")
    ap.add_argument("--cols", type=int, default=4096, help="K")
    ap.add_argument("--out", type=int, default=512, help="N (weight rows)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if native.best_isa() != "amx":
        raise SystemExit(f"no AMX path on this CPU (best: {native.best_isa()}): nothing to compare")
    vector = "avx512bf16"
    rng = np.random.default_rng(a.seed)
    print(f"m {a.rows}, K {a.cols}, N {a.out}; error over RMS(exact): Q8 activations ({vector}) | bf16 tiles (amx)")
    print("type | x | Q8 RMS | Q8 max | bf16 RMS | bf16 max | RMS ratio bf16/Q8")
    try:
        for qt in a.types.split(","):
            w = native.random_blocks(rng, qt, a.out, a.cols)
            wd = native.dequantize(w).astype(np.float64)
            for kind in ("normal", "student-t3"):
                x = activations(rng, kind, a.rows, a.cols)
                exact = x.astype(np.float64) @ wd.T
                native.set_isa(vector)
                q8 = errors(native.linear_host(x, w), exact)
                native.set_isa("amx")
                if native.block_rounding(qt, a.rows) != "bf16":
                    raise SystemExit(f"{qt}: {a.rows} rows do not take the AMX tiles; raise --rows")
                tiles = errors(native.linear_host(x, w), exact)
                print(f"{qt} | {kind} | {q8[0]:.2e} | {q8[1]:.2e} | {tiles[0]:.2e} | {tiles[1]:.2e} | "
                      f"{tiles[0] / q8[0]:.2f}", flush=True)
    finally:
        native.set_isa(None)


if __name__ == "__main__":
    main()
