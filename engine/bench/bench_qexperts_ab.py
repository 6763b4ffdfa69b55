"""Two builds of the native library on one prefill-sized MoE layer of block-quantized experts, A/B alternated.

    python -m engine.bench.bench_qexperts_ab OLD.so NEW.so                      # Mixtral width, Q4_K_M's types
    python -m engine.bench.bench_qexperts_ab OLD.so NEW.so --types q8_0,q8_0,q8_0 --counts 64,64,64,64,64,64,64,64
    python -m engine.bench.bench_qexperts_ab A.so A.so --threads 1 --new-threads 2    # one build: thread scaling
    python -m engine.bench.bench_qexperts_ab A.so A.so --strategy rows --new-strategy experts   # one build: plans

One layer of `len(--counts)` SwiGLU experts (random blocks, `--hidden` x `--inter`, gate / up / down of `--types`)
called through each build's `ms_qexperts` (the offload executor's host entry; the FFI handler runs the same code)
on `sum(counts)` token rows, expert e taking counts[e] of them: by default the rows per expert of moescope's
256-token prefill of the 1-layer Mixtral-width Q4_K_M GGUF (`/tmp/gg/mix1-q4_k_m.gguf`, top-2 of 8). The builds
are alternated call by call (the first swapped every other repeat), so load on a shared machine falls on both
alike; figures are medians of wall time over `--repeats` calls, with each expert's own wall time (the kernel's
`seconds` output), TFLOP/s of the layer (2 x 3 x H x F multiply-adds per row) and the process CPU time of a call
(CPU / wall near the thread count: every thread busy; under load the wall time also holds the waits for a core, the
CPU time does not). Outputs of the two builds are
compared (max |difference|).
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import time

import numpy as np

from models import native

PREFILL_COUNTS = "102,71,52,69,67,23,56,72"  # rows per expert, 256-token prefill of mix1-q4_k_m.gguf (top-2 of 8)
STRATEGIES = {"auto": 0, "rows": 1, "experts": 2}  # ms_qexperts' strategy argument


def open_library(path: str, isa: str) -> ctypes.CDLL:
    """The library at `path` on ISA path `isa`, its ms_qexperts declared."""
    lib = ctypes.CDLL(path)
    native._declare(lib)  # the same signatures as the loaded library's
    if lib.ms_set_isa(isa.encode()) != 0:
        raise SystemExit(f"{path}: ISA path {isa!r} unavailable")
    return lib


def layer_call(lib: ctypes.CDLL, x: np.ndarray, w: "native.ExpertWeights", offsets: np.ndarray, tokens: np.ndarray,
               pw: np.ndarray, out: np.ndarray, secs: np.ndarray, threads: int, strategy: int = 0) -> tuple[float, float]:
    """Wall and process CPU seconds of one layer call (out zeroed first, outside the timing); strategy: ms_qexperts'
    thread plan (0 auto, 1 rows split, 2 whole experts per thread)."""
    out[:] = 0
    qg, qu, qd = (native.QTYPE_IDS[q] for q in w.qtypes)
    c = cpu_seconds()
    t = time.perf_counter()
    rc = lib.ms_qexperts(x.ctypes.data, 0, x.shape[0], w.hidden, w.intermediate, qg, qu, qd, w.n, *w.addresses,
                         offsets.ctypes.data, len(tokens), tokens.ctypes.data, pw.ctypes.data, out.ctypes.data,
                         threads, secs.ctypes.data, strategy)
    if rc != 0:
        raise RuntimeError(lib.ms_last_error().decode())
    return time.perf_counter() - t, cpu_seconds() - c


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--types", default="q4_k,q4_k,q6_k", help="gate,up,down block types")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--counts", default=PREFILL_COUNTS, help="rows per expert")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-threads", type=int, help="threads for NEW (default --threads)")
    ap.add_argument("--isa", default="amx")
    ap.add_argument("--strategy", choices=["auto", "rows", "experts"], default="auto", help="thread plan of both")
    ap.add_argument("--new-strategy", choices=["auto", "rows", "experts"], help="thread plan of NEW (default --strategy)")
    a = ap.parse_args(argv)
    plans = {"old": STRATEGIES[a.strategy], "new": STRATEGIES[a.new_strategy or a.strategy]}
    counts = [int(v) for v in a.counts.split(",")]
    qg, qu, qd = a.types.split(",")
    H, F, E = a.hidden, a.inter, len(counts)
    rng = np.random.default_rng(0)
    gates = [native.random_blocks(rng, qg, F, H) for _ in range(E)]
    ups = [native.random_blocks(rng, qu, F, H) for _ in range(E)]
    downs = [native.random_blocks(rng, qd, H, F) for _ in range(E)]
    w = native.pack_experts(gates, ups, downs)
    T = sum(counts)
    x = rng.standard_normal((T, H)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    tokens = rng.permutation(T).astype(np.int32)  # each row once: the pairs' tokens in expert order
    pw = rng.uniform(0.2, 0.8, T).astype(np.float32)
    libs = {"old": (open_library(a.old, a.isa), a.threads), "new": (open_library(a.new, a.isa), a.new_threads or a.threads)}
    outs = {n: np.zeros((T, H), np.float32) for n in libs}
    times = {n: [] for n in libs}
    cpus = {n: [] for n in libs}
    per = {n: [] for n in libs}
    for r in range(a.repeats + 1):
        for n, (lib, th) in (libs.items() if r % 2 == 0 else reversed(libs.items())):
            secs = np.zeros(E, np.float64)
            t, c = layer_call(lib, x, w, offsets, tokens, pw, outs[n], secs, th, plans[n])
            if r:  # the first call of each warms up
                times[n].append(t)
                cpus[n].append(c)
                per[n].append(secs)
    flop = 2.0 * 3 * H * F * T
    print(f"{E} experts [{H} x {F}] {a.types}, rows {counts} ({T}), isa {a.isa}, threads old {a.threads} / new "
          f"{a.new_threads or a.threads}, plans old {a.strategy} / new {a.new_strategy or a.strategy}, {a.repeats} calls "
          f"each alternated")
    for n in libs:
        med = float(np.median(times[n]))
        pe = np.median(np.array(per[n]), axis=0) * 1e3
        cpu = float(np.median(cpus[n]))
        print(f"{n}: layer {med * 1e3:8.3f} ms ({flop / med / 1e12:.2f} TFLOP/s), CPU {cpu * 1e3:.1f} ms (CPU / wall "
              f"{cpu / med:.2f}; {flop / cpu / 1e12:.2f} TFLOP per CPU-second); per expert ms "
              f"{' '.join(f'{v:.3g}' for v in pe)}")
    ratio = np.array(times["old"]) / np.array(times["new"])
    print(f"new/old speed: median {np.median(ratio):.2f}x (range {ratio.min():.2f}-{ratio.max():.2f}); max |diff| "
          f"{np.abs(outs['old'] - outs['new']).max():.2e}")


if __name__ == "__main__":
    main()
