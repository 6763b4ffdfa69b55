"""Two builds of the native library side by side: single-core block-quantized matvec / small-GEMM rates, A/B.

    python -m engine.bench.bench_qlinear_ab OLD.so NEW.so                       # every block type, m = 1 and 8
    python -m engine.bench.bench_qlinear_ab OLD.so NEW.so --types q4_k,q6_k --rows 14336 --cols 4096

Each library (`models/native/_build/moescope_native-<hash>.so`: build the old source once, keep its file) is loaded
with ctypes and its `ms_qlinear` (one thread, AVX512-VNNI path) timed on the same random blocks, the two builds
alternated call by call, so load on a shared machine falls on both alike. A figure is the best of `--repeats`
calls by thread CPU time (a call waiting for a core costs nothing; memory contention still does): weights per
second and the blocks' bytes per second. Outputs of the two builds are compared (max |difference|): a kernel
rewrite that keeps the arithmetic exact moves them only by f32 rounding.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

from models import native


def open_library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    c = ctypes
    lib.ms_qlinear.restype = c.c_int
    lib.ms_qlinear.argtypes = [c.c_void_p, c.c_int, c.c_int64, c.c_int64, c.c_void_p, c.c_int, c.c_int64,
                               c.c_void_p, c.c_int]
    lib.ms_set_isa.argtypes = [c.c_char_p]
    lib.ms_set_isa(b"avx512bf16")
    return lib


def best_time(lib: ctypes.CDLL, x: np.ndarray, w, y: np.ndarray) -> float:
    t = time.thread_time()
    rc = lib.ms_qlinear(x.ctypes.data, 0, x.shape[0], x.shape[1], w.data.ctypes.data, native.QTYPE_IDS[w.qtype],
                        w.shape[0], y.ctypes.data, 1)
    if rc != 0:
        raise RuntimeError(f"ms_qlinear failed ({rc})")
    return time.thread_time() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--types", default="q4_k,q6_k,q8_0,q4_0")
    ap.add_argument("--rows", type=int, default=14336)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--repeats", type=int, default=21)
    a = ap.parse_args(argv)
    libs = {"old": open_library(a.old), "new": open_library(a.new)}
    rng = np.random.default_rng(0)
    print("type | m | old G weights/s (GB/s) | new G weights/s (GB/s) | new/old | max |diff|")
    for qt in a.types.split(","):
        w = native.random_blocks(rng, qt, a.rows, a.cols)
        for m in (int(v) for v in a.m.split(",")):
            x = rng.standard_normal((m, a.cols)).astype(np.float32)
            ys = {n: np.empty((m, a.rows), np.float32) for n in libs}
            times: dict[str, list[float]] = {n: [] for n in libs}
            for _ in range(a.repeats):
                for n, lib in libs.items():
                    times[n].append(best_time(lib, x, w, ys[n]))
            rate = {n: a.rows * a.cols / min(v) / 1e9 for n, v in times.items()}
            gbs = {n: w.nbytes / min(v) / 1e9 for n, v in times.items()}
            diff = float(np.abs(ys["old"] - ys["new"]).max())
            print(f"{qt} | {m} | {rate['old']:.1f} ({gbs['old']:.1f}) | {rate['new']:.1f} ({gbs['new']:.1f}) | "
                  f"{rate['new'] / rate['old']:.2f}x | {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
