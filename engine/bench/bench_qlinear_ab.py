"""Two builds of the native library side by side: single-core block-quantized (or bf16) matvec / GEMM rates, A/B.

    python -m engine.bench.bench_qlinear_ab OLD.so NEW.so                       # every block type, m = 1 and 8
    python -m engine.bench.bench_qlinear_ab OLD.so NEW.so --types q4_k,q6_k --rows 14336 --cols 4096
    python -m engine.bench.bench_qlinear_ab OLD.so NEW.so --m 1,2,4,8 --mib 768      # weights from memory
    python -m engine.bench.bench_qlinear_ab OLD.so NEW.so --m 16,64 --isa amx --types bf16,q8_0   # AMX on both
    python -m engine.bench.bench_qlinear_ab OLD.so NEW.so --rounding-only --m 1,4 --cols 2048   # activation rounding
    python -m engine.bench.bench_qlinear_ab A.so B.so --isa avx512bf16 --new-isa amx --new-amx-rows=1 --m 4,8,12,16
        # the block types' AVX-512 path against their AMX tiles at every row count: one build under two file names
    python -m engine.bench.bench_qlinear_ab A.so B.so --old-prefetch l2 --new-prefetch l1 --m 1,4,8 --mib 512
        # one build (two file names), its block kernels' weight prefetch into L2 against L1 (native.set_qprefetch)

Each library (`models/native/_build/moescope_native-<hash>.so`: build the old source once, keep its file) is loaded
with ctypes and its `ms_qlinear` (one thread unless `--threads`, AVX512-VNNI path unless `--isa`) timed on the same
random blocks, the two builds alternated call by call, so load on a shared machine falls on both alike. By default
one matrix is called again and again (it stays in the caches: the kernels' compute rate); `--mib N` cycles over
distinct matrices of N MiB in all, so that (N well above the L3) every call reads its weights from memory. A figure is the best of `--repeats`
calls by thread CPU time (a call waiting for a core costs nothing; memory contention still does): weights per
second and the blocks' bytes per second. Outputs of the two builds are compared (max |difference|): a kernel
rewrite that keeps the arithmetic exact moves them only by f32 rounding. With `--mib`, "of read" is each figure's
GB/s over the native streaming read of `--mib` MiB on one thread, timed the same way (thread CPU time, best of the
same calls, measured before every type): a per-core share of the read rate that a loaded machine's preemption
does not skew, unlike wall-clock ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import ml_dtypes
import numpy as np

from models import native

BF16 = ml_dtypes.bfloat16


def random_weights(rng: np.random.Generator, qtype: str, rows: int, cols: int):
    """bf16 weights (an ndarray) or ggml blocks (a QuantArray) of shape [rows, cols]."""
    if qtype == "bf16":
        return (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(BF16)
    return native.random_blocks(rng, qtype, rows, cols)


def open_library(path: str, isa: str, amx_rows: int | None = None, prefetch: str | None = None) -> ctypes.CDLL:
    """The library at `path` on ISA path `isa`; amx_rows: rows from which every block type takes the AMX tiles on the
    amx path (ms_set_amx_rows: > 0 from there, 0 the build's default, < 0 never); prefetch: its block kernels' weight
    prefetch level (ms_set_qprefetch: l1, l2, off; None: the build's default for this CPU)."""
    lib = ctypes.CDLL(path)
    c = ctypes
    lib.ms_qlinear.restype = c.c_int
    lib.ms_qlinear.argtypes = [c.c_void_p, c.c_int, c.c_int64, c.c_int64, c.c_void_p, c.c_int, c.c_int64,
                               c.c_void_p, c.c_int]
    lib.ms_linear.restype = c.c_int
    lib.ms_linear.argtypes = [c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p, c.c_int, c.c_int]
    lib.ms_set_isa.argtypes = [c.c_char_p]
    if lib.ms_set_isa(isa.encode()) != 0:
        raise SystemExit(f"{path}: ISA path {isa!r} unavailable")
    if amx_rows is not None:
        if not hasattr(lib, "ms_set_amx_rows"):
            raise SystemExit(f"{path}: this build has no ms_set_amx_rows (AMX thresholds are fixed)")
        lib.ms_set_amx_rows.argtypes = [ctypes.c_int, ctypes.c_int]
        for qid in native.QTYPE_IDS.values():
            lib.ms_set_amx_rows(qid, amx_rows)
    if prefetch is not None:
        if not hasattr(lib, "ms_set_qprefetch"):
            raise SystemExit(f"{path}: this build has no ms_set_qprefetch (its prefetch level is fixed)")
        lib.ms_set_qprefetch.argtypes = [ctypes.c_char_p]
        if lib.ms_set_qprefetch(prefetch.encode()) != 0:
            raise SystemExit(f"{path}: unknown prefetch level {prefetch!r} (l1, l2, off)")
    return lib


def best_time(lib: ctypes.CDLL, x: np.ndarray, w, y: np.ndarray, threads: int = 1) -> float:
    """Seconds of one call: thread CPU time on one thread, wall time with more (the helpers' time is elsewhere)."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    t = clock()
    if isinstance(w, np.ndarray):  # bf16 weights: x given as bf16 (ms_linear's bf16 activation)
        assert x.dtype == BF16, "bf16 weights take bf16 activations"
        rc = lib.ms_linear(x.ctypes.data, x.shape[0], x.shape[1], w.ctypes.data, w.shape[0], y.ctypes.data, 0, threads)
    else:
        rc = lib.ms_qlinear(x.ctypes.data, 0, x.shape[0], x.shape[1], w.data.ctypes.data, native.QTYPE_IDS[w.qtype],
                            w.shape[0], y.ctypes.data, threads)
    if rc != 0:
        raise RuntimeError(f"ms_qlinear failed ({rc})")
    return clock() - t


def rounding_time(lib: ctypes.CDLL, x: np.ndarray, qtype: str, q: np.ndarray, d: np.ndarray) -> float:
    """Thread CPU seconds of the activation rounding alone (ms_qquantize: x f32 [m, K] to Q8_0 / Q8_K for `qtype`)."""
    args = (x.ctypes.data, x.shape[0], x.shape[1], native.QTYPE_IDS[qtype], q.ctypes.data, d.ctypes.data)
    t = time.thread_time()  # (~0.5 us of the figure is the clock's and ctypes' own, the same for both builds)
    rc = lib.ms_qquantize(*args)
    t = time.thread_time() - t
    if rc:
        raise RuntimeError("ms_qquantize failed")
    return t


def rounding_ab(libs: dict, qtypes: list[str], ms: list[int], cols: int, repeats: int) -> None:
    """The activation rounding of m x cols values per type, the builds alternated: best thread CPU time, ns a value."""
    rng = np.random.default_rng(0)
    print("type | m x K | old us (ns a value) | new us (ns a value) | new/old | q, d equal")
    for qt in qtypes:
        for m in ms:
            x = rng.standard_normal((m, cols)).astype(np.float32)
            out = {n: (np.zeros((m, cols), np.int8), np.zeros((m, cols // 32), np.float32)) for n in libs}
            times: dict[str, list[float]] = {n: [] for n in libs}
            for r in range(repeats):
                for n, lib in (libs.items() if r % 2 == 0 else reversed(libs.items())):
                    times[n].append(rounding_time(lib, x, qt, *out[n]))
            same = all(np.array_equal(a, b) for a, b in zip(out["old"], out["new"]))
            t = {n: min(v) for n, v in times.items()}
            print(f"{qt} | {m} x {cols} | {t['old'] * 1e6:.1f} ({t['old'] / x.size * 1e9:.2f}) | {t['new'] * 1e6:.1f} "
                  f"({t['new'] / x.size * 1e9:.2f}) | {t['old'] / t['new']:.2f}x | {same}", flush=True)


def read_rate(mib: float, repeats: int) -> float:
    """GB/s of the native streaming read of `mib` MiB on this thread, by thread CPU time (best of `repeats`)."""
    data = np.ones(int(mib * 2**20) // 8, np.float64)
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        native.stream_read(data, 1)
        best = min(best, time.thread_time() - t)
    return data.nbytes / best / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--types", default="q4_k,q6_k,q8_0,q4_0")
    ap.add_argument("--rows", type=int, default=14336)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--mib", type=float, default=0.0, help="cycle over distinct matrices of this many MiB in all")
    ap.add_argument("--isa", default="avx512bf16", help="ISA path forced on both builds (amx: tiles for m >= 16)")
    ap.add_argument("--new-isa", help="another path for NEW (default --isa): with a copy of one build under two file "
                    "names, the two paths of that build A/B (e.g. --isa avx512bf16 --new-isa amx)")
    ap.add_argument("--old-amx-rows", type=int, help="rows from which OLD's block types take the AMX tiles on the amx "
                    "path (> 0 from there, 0 the build's default, < 0 never)")
    ap.add_argument("--new-amx-rows", type=int, help="the same for NEW")
    ap.add_argument("--old-prefetch", help="OLD's block-kernel weight prefetch level (l1, l2, off; default: the build's)")
    ap.add_argument("--new-prefetch", help="the same for NEW")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounding-only", action="store_true", help="time the activation rounding alone (ms_qquantize "
                    "of m x --cols values) instead of the matmul")
    a = ap.parse_args(argv)
    libs = {"old": open_library(a.old, a.isa, a.old_amx_rows, a.old_prefetch),
            "new": open_library(a.new, a.new_isa or a.isa, a.new_amx_rows, a.new_prefetch)}
    if a.rounding_only:
        for lib in libs.values():
            lib.ms_qquantize.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                         ctypes.c_void_p]
        return rounding_ab(libs, a.types.split(","), [int(v) for v in a.m.split(",")], a.cols, a.repeats)
    rng = np.random.default_rng(0)
    print(f"ISA {a.isa}{' / ' + a.new_isa if a.new_isa else ''}, {a.threads} thread(s), {'weights from memory' if a.mib else 'one matrix (cached)'}")
    print("type | m | old G weights/s (GB/s) | new G weights/s (GB/s) | new/old | max |diff|")
    for qt in a.types.split(","):
        ws = [random_weights(rng, qt, a.rows, a.cols)]
        while sum(v.nbytes for v in ws) < a.mib * 2**20:
            ws.append(random_weights(rng, qt, a.rows, a.cols))
        w = ws[0]
        read = read_rate(a.mib, a.repeats) if a.mib and a.threads == 1 else 0.0
        if read:
            print(f"{qt}: 1-thread streaming read {read:.1f} GB/s (thread CPU time, {a.mib:.0f} MiB)", flush=True)
        for m in (int(v) for v in a.m.split(",")):
            x = rng.standard_normal((m, a.cols)).astype(BF16 if qt == "bf16" else np.float32)
            ys = {n: np.empty((m, a.rows), np.float32) for n in libs}
            times: dict[str, list[float]] = {n: [] for n in libs}
            calls = 0  # every call takes the next matrix: with --mib, the least recently read one
            for r in range(a.repeats):
                for n, lib in (libs.items() if r % 2 == 0 else reversed(libs.items())):
                    calls += 1
                    times[n].append(best_time(lib, x, ws[calls % len(ws)], ys[n], a.threads))
            for n, lib in libs.items():  # the outputs compared: both builds on the same matrix
                best_time(lib, x, w, ys[n], a.threads)
            rate = {n: a.rows * a.cols / min(v) / 1e9 for n, v in times.items()}
            gbs = {n: w.nbytes / min(v) / 1e9 for n, v in times.items()}
            diff = float(np.abs(ys["old"] - ys["new"]).max())
            share = f" | of read {gbs['old'] / read:.0%} -> {gbs['new'] / read:.0%}" if read else ""
            print(f"{qt} | {m} | {rate['old']:.1f} ({gbs['old']:.1f}) | {rate['new']:.1f} ({gbs['new']:.1f}) | "
                  f"{rate['new'] / rate['old']:.2f}x | {diff:.2e}{share}", flush=True)


if __name__ == "__main__":
    main()
