"""How fast one bf16 SwiGLU expert runs on the host: moescope's native kernels against torch, at real widths.

    python -m engine.bench.bench_cpu_experts                         # 1 and 2 threads, 3 rounds
    python -m engine.bench.bench_cpu_experts --threads 1 --repeats 12 --rounds 5

For Mixtral (H 4096, F 14336), DeepSeek-V2-Lite (2048, 1408) and Qwen3-30B-A3B (2048, 768) experts and
m = 1, 4, 16, 64 rows, one expert is timed through `models.native.experts_host` (the CPU-experts path),
cycling over DISTINCT experts whose weights together exceed the L3 cache several times, so every call
reads its weights from memory as a decode step does. Next to it: torch's bf16 path (F.linear x3 + silu,
as the engine's torch fallback computes a bf16 expert) and torch f32 on upcast weights, same m. Rates
are weight bytes (bf16, even for the f32 run) per second; the ratio is to the native streaming read of a 256 MiB
array with the same thread count, measured right before and after the figure's calls (the better of
the two; the header also prints torch's sum of the same array). A 1-thread ratio is therefore per core:
the machine's ceiling is the read with every core (the highest `--threads`), about twice one core's on
a 2-core VM, and llama.cpp's decode on all cores is measured against that, not against one core. This
machine is shared and other work comes and goes: every native figure and read rate is the best over
`--rounds` passes of `--repeats` calls each (torch: one pass, so torch ratios lean against torch).

Layer section: a whole decode layer's routed experts in ONE `experts_host` call, at each model's real
expert count and top-k (Mixtral 2 of 8, DeepSeek-V2-Lite 6 of 64, Qwen3-30B-A3B 8 of 128; the other
experts get no pair and are never read), m = 1 and 4 tokens per expert (the same m tokens routed to each
of the k experts), distinct experts every call (weights from memory). Rates are the k experts' weight
bytes per second, next to the per-expert rate of the first table; the auto plan is shown with the
forced row-split and expert-parallel plans (`strategy=`), which compute the same bits. The same layers
also run through the XLA FFI `models.native.experts` inside one jitted program (a fori_loop over
`--repeats` layer calls, weights as jax arrays aliasing the numpy ones -- the same pages, as XLA's own
buffers get no huge pages and stream ~15% slower -- the mean per call, best of the rounds).

A last table gives the fixed cost per expert of a tiny model layer (H 256) run in one native call
against one torch call chain per expert.

Types section (`--types`, default bf16,q8_0,q4_0,q4_k,q6_k,q4_k_m; `--types-only` runs just it): one expert per
call at each width and m = 1, 4, 16, 64 for every weight type, bf16 and ggml's block types (random blocks,
distinct experts ~5x the L3 as above), on the best ISA path (`--isa best`: AMX for m >= 16 where the CPU has
it; bf16 also on "today's" AVX512-BF16 path, `bf16@avx512`) or on the path moescope serves with by default
(`--isa default`: AMX off, see `models.native.default_isa`). `q4_k_m` is llama.cpp's Q4_K_M expert in the
layers it gives more bits (gate and up Q4_K, down Q6_K); its other layers are the `q4_k` row. Columns: GB/s of
the expert's (quantized) bytes and their fraction of the read rate measured around the figure; TOP/s
(2 x m x 3HF / time) and its ratio to today's bf16 kernel at the same width and m. After the table, per type:
whether every width reads at >= 70 % of the read rate at m <= 4 (the issue's target), and the time per m
relative to bf16 at the same width and m (what `schedulers/format_rates.yaml` is fitted from; `--json OUT`
writes every figure). DeepSeek-V2-Lite's F = 1408 is not a whole number of 256-weight blocks: its K-quant
experts take down in llama.cpp's fallback type (q4_k -> q4_0, q6_k -> q8_0), named in the table.
    python -m engine.bench.bench_cpu_experts --types-only --threads 2 --rounds 2
    python -m engine.bench.bench_cpu_experts --types-only --types bf16,q8_0,q4_k,q4_k_m --isa default --json rates.json
    python -m engine.bench.bench_cpu_experts --types-only --types bf16,q8_0,q4_0,q4_k,q6_k,q4_k_m --isa default \
        --widths mixtral,qwen3-30b-a3b --rounds 5 --rates-yaml schedulers/data/block_rates.yaml
The last one refits the simulator's CPU rates per block type (engine/bench/block_rates_fit.py: eq. 2 of each type
over bf16's at Mixtral width, checked at every other width and m; the file records where it was measured).
Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.bench.block_rates_fit import MIXES, write_rates_yaml  # noqa: E402
from models import native  # noqa: E402

WIDTHS = {"mixtral": (4096, 14336), "deepseek-v2-lite": (2048, 1408), "qwen3-30b-a3b": (2048, 768)}
LAYERS = {"mixtral": (8, 2), "deepseek-v2-lite": (64, 6), "qwen3-30b-a3b": (128, 8)}  # (routed experts, top-k)
ROWS = (1, 4, 16, 64)
LAYER_ROWS = (1, 4)
STRATEGIES = ("auto", "rows", "experts")
L3_BYTES = 32 * 2**20
SWEEP_BYTES = 256 * 2**20
BF16 = ml_dtypes.bfloat16


def random_bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Weights-like bf16 values: random sign and mantissa, magnitudes in [2^-7, 2^-6) (no denormals/NaN)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return ((bits & np.uint16(0x807F)) | np.uint16(0x3C00)).view(BF16)


def aligned(a: np.ndarray) -> np.ndarray:
    """A 64-byte aligned copy of `a` (jax can then use its memory as is: `jax.device_put(..., may_alias=True)`)."""
    buf = np.empty(a.nbytes + 64, np.uint8)
    start = -buf.ctypes.data % 64
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def torch_bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def best_seconds(fn: Callable[[int], None], calls: int) -> float:
    """Best wall time of fn(i) over `calls` calls (after one warm-up call)."""
    fn(calls)
    best = math.inf
    for i in range(calls):
        t = time.perf_counter()
        fn(i)
        best = min(best, time.perf_counter() - t)
    return best


def read_rates(threads: int, repeats: int = 8) -> tuple[float, float]:
    """(native streaming read, torch sum) GB/s over a 256 MiB array with `threads` threads."""
    data = np.ones(SWEEP_BYTES // 8, np.float64)
    nat = SWEEP_BYTES / best_seconds(lambda i: native.stream_read(data, threads), repeats) / 1e9
    torch.set_num_threads(threads)
    t = torch.ones(SWEEP_BYTES // 4)
    tor = SWEEP_BYTES / best_seconds(lambda i: t.sum(), repeats) / 1e9
    return nat, tor


class ReadProbe:
    """The memory read rate right now (GB/s, best of a few native streaming reads of 256 MiB): this VM's read
    rate moves by up to 2x within seconds (other tenants, where the host places the two vCPUs), so a rate is
    only comparable with a read measured at the same moment."""

    def __init__(self) -> None:
        self.data = np.ones(SWEEP_BYTES // 8, np.float64)

    def read_now(self, threads: int) -> float:
        return SWEEP_BYTES / best_seconds(lambda i: native.stream_read(self.data, threads), 4) / 1e9


class Figures(ReadProbe):
    """Best time of each figure over the rounds, with the memory read rate measured right before and after the
    calls that gave it (the better of the two)."""

    def __init__(self) -> None:
        super().__init__()
        self.best: dict[tuple, float] = {}
        self.read: dict[tuple, float] = {}

    def measure(self, key: tuple, threads: int, fn: Callable[[], float]) -> None:
        before = self.read_now(threads)
        seconds = fn()
        read = max(before, self.read_now(threads))
        if seconds < self.best.get(key, math.inf):
            self.best[key], self.read[key] = seconds, read

    def gbs(self, key: tuple, nbytes: float) -> tuple[float, float, float]:
        """(seconds, GB/s, fraction of the read rate of the same moment)."""
        s = self.best[key]
        return s, nbytes / s / 1e9, nbytes / s / 1e9 / self.read[key]


class Experts:
    """`count` distinct bf16 experts of one width (gate, up [F, H], down [H, F]; gate and up are the two halves of
    one gate_up [2F, H] array), and a model layer of `n_layer` experts (top-k `k`) whose slot e holds distinct
    expert e % count: each layer call routes to one window of k distinct experts, the windows taken in turn."""

    def __init__(self, hidden: int, inter: int, n_layer: int, k: int, seed: int = 0):
        self.hidden, self.inter, self.n_layer, self.k = hidden, inter, n_layer, k
        self.bytes = 3 * hidden * inter * 2
        count = max(3, math.ceil(5 * L3_BYTES / self.bytes))  # weights ~5x the L3 (at least 3 experts) ...
        self.count = min(n_layer, max(2 * k, math.ceil(count / k) * k))  # ... and whole windows of k
        rng = np.random.default_rng(seed)
        self.gate_up = [aligned(random_bf16(rng, (2 * inter, hidden))) for _ in range(self.count)]
        self.down = [aligned(random_bf16(rng, (hidden, inter))) for _ in range(self.count)]
        self.weights = [(gu[:inter], gu[inter:], d) for gu, d in zip(self.gate_up, self.down)]
        self.packed = [native.pack_experts([g], [u], [d]) for g, u, d in self.weights]
        self.layer = native.pack_experts(*zip(*(self.weights[e % self.count] for e in range(n_layer))))
        self.windows = self.count // k
        self.torch = [tuple(torch_bf16(a) for a in w) for w in self.weights]

    def routing(self, m: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """(tokens, pair weights, offsets of each window): m tokens routed to each of the window's k experts."""
        tokens = np.tile(np.arange(m, dtype=np.int32), self.k)
        pw = np.random.default_rng(m).uniform(0.1, 1.0, m * self.k).astype(np.float32)
        offsets = []
        for w in range(self.windows):
            count = np.zeros(self.n_layer, np.int64)
            count[w * self.k:(w + 1) * self.k] = m
            offsets.append(np.concatenate([[0], np.cumsum(count)]).astype(np.int64))
        return tokens, pw, offsets


def time_native(ex: Experts, m: int, threads: int, calls: int) -> float:
    x = np.ascontiguousarray(random_bf16(np.random.default_rng(m), (m, ex.hidden)) * BF16(64))
    out = np.zeros((m, ex.hidden), np.float32)
    offsets, tokens, pw = np.array([0, m], np.int64), np.arange(m, dtype=np.int32), np.ones(m, np.float32)

    def call(i: int) -> None:
        native.experts_host(out, x, ex.packed[i % ex.count], None, None, offsets, tokens, pw, threads=threads)

    return best_seconds(call, calls)


def time_layer(ex: Experts, m: int, threads: int, calls: int, strategy: str) -> float:
    """Best wall time of one layer call (`experts_host`, k experts x m tokens, a new window every call)."""
    x = np.ascontiguousarray(random_bf16(np.random.default_rng(m), (m, ex.hidden)) * BF16(64))
    out = np.zeros((m, ex.hidden), np.float32)
    tokens, pw, offsets = ex.routing(m)

    def call(i: int) -> None:
        native.experts_host(out, x, ex.layer, None, None, offsets[i % ex.windows], tokens, pw, threads=threads,
                            strategy=strategy)

    return best_seconds(call, calls)


class FfiLayer:
    """The layer of `ex` through the XLA FFI: one jitted program runs `calls` layer calls in a fori_loop
    (window i % windows on call i), the weights jax arrays (one gate_up and one down per layer slot) on the
    same memory as the host calls' numpy arrays (`aliased`), so both read the same pages: numpy asks for
    transparent huge pages and XLA's own buffers get 4 KiB pages, which stream ~15% slower here."""

    def __init__(self, ex: Experts, m: int, calls: int):
        import jax
        import jax.numpy as jnp

        def on_device(a: np.ndarray) -> jax.Array:
            try:
                return jax.device_put(a, may_alias=True)
            except TypeError:  # an older jax without may_alias: a copy
                return jnp.asarray(a)

        gate_up = [on_device(a) for a in ex.gate_up]
        down = [on_device(a) for a in ex.down]
        self.aliased = all(np.shares_memory(np.asarray(j), a) for j, a in zip(gate_up + down, ex.gate_up + ex.down))
        self.gate_up = [gate_up[e % ex.count] for e in range(ex.n_layer)]
        self.down = [down[e % ex.count] for e in range(ex.n_layer)]
        tokens, pw, offsets = ex.routing(m)
        self.args = (jnp.asarray(random_bf16(np.random.default_rng(m), (m, ex.hidden)) * BF16(64)),
                     jnp.asarray(tokens), jnp.asarray(pw), jnp.asarray(np.stack(offsets).astype(np.int32)))
        self.calls, windows = calls, ex.windows

        def program(x, tokens, pw, offsets, gate_up, down):
            def body(i, acc):
                return acc + native.experts(x, tokens, pw, offsets[i % windows], gate_up, down)
            return jax.lax.fori_loop(0, calls, body, jnp.zeros(x.shape, jnp.float32))

        self.fn = jax.jit(program)
        self.run()  # compile, warm up

    def run(self) -> None:
        self.fn(*self.args, self.gate_up, self.down).block_until_ready()

    def seconds(self, threads: int) -> float:
        """Mean time of one layer call over one run of the program with `threads` kernel threads."""
        native.set_threads(threads)
        t = time.perf_counter()
        self.run()
        return (time.perf_counter() - t) / self.calls


def time_torch(weights: list[tuple[torch.Tensor, ...]], hidden: int, m: int, dtype: torch.dtype, threads: int,
               calls: int) -> float:
    torch.set_num_threads(threads)
    x = torch.randn(m, hidden).to(dtype)
    F = torch.nn.functional

    def call(i: int) -> None:
        gate, up, down = weights[i % len(weights)]
        h = F.silu(F.linear(x, gate)).mul_(F.linear(x, up))
        F.linear(h, down).float()

    with torch.inference_mode():
        return best_seconds(call, calls)


def tiny_overhead(threads: int, calls: int) -> tuple[float, float]:
    """Microseconds per expert of a tiny layer (H 256, F 128, 8 experts x 2 tokens): native (one call) and torch."""
    H, F, E = 256, 128, 8
    rng = np.random.default_rng(1)
    ws = [(random_bf16(rng, (F, H)), random_bf16(rng, (F, H)), random_bf16(rng, (H, F))) for _ in range(E)]
    x = random_bf16(rng, (8, H)) * BF16(64)
    offsets = np.arange(0, 2 * E + 1, 2, dtype=np.int64)
    tokens = (np.arange(2 * E) % 8).astype(np.int32)
    pw = np.ones(2 * E, np.float32)
    out = np.zeros((8, H), np.float32)
    packed = native.pack_experts(*zip(*ws))
    nat = best_seconds(lambda i: native.experts_host(out, x, packed, None, None, offsets, tokens, pw, threads), calls)
    torch.set_num_threads(threads)
    tw = [tuple(torch_bf16(a) for a in w) for w in ws]
    xt, out_t = torch_bf16(np.ascontiguousarray(x)), torch.zeros(8, H)
    tok_t, w_t = torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(pw)
    Fn = torch.nn.functional

    def torch_layer(i: int) -> None:
        for e, (gate, up, down) in enumerate(tw):
            idx = tok_t[2 * e:2 * e + 2]
            rows = xt.index_select(0, idx)
            h = Fn.silu(Fn.linear(rows, gate)).mul_(Fn.linear(rows, up))
            out_t.index_add_(0, idx, Fn.linear(h, down).float().mul_(w_t[2 * e:2 * e + 2, None]))

    with torch.inference_mode():
        tor = best_seconds(torch_layer, calls)
    return nat / E * 1e6, tor / E * 1e6


def print_layers(experts: dict[str, Experts], threads_list: list[int], fig: Figures, ffis: list[FfiLayer]) -> None:
    print("\nlayer: one decode layer's routed experts in one call (k experts x m tokens, the layer's other experts "
          "empty); GB/s of the k experts' bf16 weights")
    head = (f"{'width':17s} {'E':>3s} {'k':>2s} {'m':>2s} {'thr':>3s} | {'expert GB/s':>11s} {'of read':>7s} | "
            f"{'layer ms':>8s} {'GB/s':>6s} {'of read':>7s} | {'rows':>5s} {'experts':>7s} | "
            f"{'FFI ms':>7s} {'GB/s':>6s} {'of read':>7s}")
    print(f"{head}\n{'-' * len(head)}")
    for name, ex in experts.items():
        nbytes = ex.k * ex.bytes
        for th in threads_list:
            for m in LAYER_ROWS:
                _, one, one_frac = fig.gbs((name, m, th), ex.bytes)
                s, gbs, frac = fig.gbs((name, m, th, "auto"), nbytes)
                forced = "".join(f" {fig.gbs((name, m, th, st), nbytes)[1]:{w}.1f}" if th > 1 else f" {'-':>{w}s}"
                                 for st, w in (("rows", 5), ("experts", 7)))
                line = (f"{name:17s} {ex.n_layer:3d} {ex.k:2d} {m:2d} {th:3d} | {one:11.1f} {one_frac:7.0%} | "
                        f"{s * 1e3:8.3f} {gbs:6.1f} {frac:7.0%} |{forced} |")
                if (name, m, th, "ffi") in fig.best:
                    f, fgbs, ffrac = fig.gbs((name, m, th, "ffi"), nbytes)
                    line += f" {f * 1e3:7.3f} {fgbs:6.1f} {ffrac:7.0%}"
                else:
                    line += f" {'-':>7s}"
                print(line, flush=True)
    aliased = all(f.aliased for f in ffis)
    print("'expert': one expert per call (first table, same m); 'layer': the auto plan; 'rows' / 'experts': GB/s "
          "with the row-split / expert-parallel plan forced; 'FFI': models.native.experts in a jitted fori_loop "
          "(mean per call), weights " + ("on the host calls' memory (jax arrays aliasing the numpy ones)" if aliased
                                        else "copied into XLA buffers (4 KiB pages: slower to stream than numpy's)"))


TYPES = ("bf16", "q8_0", "q4_0", "q4_k", "q6_k", "q4_k_m")
DOWN_FALLBACK = {"q4_k": "q4_0", "q6_k": "q8_0"}  # llama.cpp's type for a K-quant tensor whose rows are not 256-aligned
READ_TARGET = 0.70  # the target: quantized bytes read at >= 70 % of the read rate for m <= 4


class TypedExperts:
    """`count` distinct experts of one width in one weight type (bf16 arrays or block-quantized QuantArrays),
    each packed on its own; weights together ~5x the L3 (at least 2 experts) so every call reads from memory."""

    def __init__(self, hidden: int, inter: int, qtype: str, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.hidden, self.inter, self.qtype = hidden, inter, qtype
        self.gate_type, down = MIXES.get(qtype, (qtype, qtype))
        self.down_type = DOWN_FALLBACK.get(down, down) if inter % 256 and down != "bf16" else down
        if qtype == "bf16":
            make = [lambda r, c: random_bf16(rng, (r, c))] * 3
        else:
            make = [lambda r, c: native.random_blocks(rng, self.gate_type, r, c)] * 2 + [
                lambda r, c: native.random_blocks(rng, self.down_type, r, c)]
        first = (make[0](inter, hidden), make[1](inter, hidden), make[2](hidden, inter))
        self.bytes = sum(w.nbytes for w in first)
        count = max(2, math.ceil(5 * L3_BYTES / self.bytes))
        self.packed = [native.pack_experts([first[0]], [first[1]], [first[2]])]
        for _ in range(count - 1):
            self.packed.append(native.pack_experts([make[0](inter, hidden)], [make[1](inter, hidden)],
                                                   [make[2](hidden, inter)]))

    def seconds(self, m: int, threads: int, calls: int) -> float:
        x = np.ascontiguousarray(random_bf16(np.random.default_rng(m), (m, self.hidden)) * BF16(64))
        out = np.zeros((m, self.hidden), np.float32)
        offsets, tokens, pw = np.array([0, m], np.int64), np.arange(m, dtype=np.int32), np.ones(m, np.float32)

        def call(i: int) -> None:
            native.experts_host(out, x, self.packed[i % len(self.packed)], None, None, offsets, tokens, pw,
                                threads=threads)

        return best_seconds(call, calls)


def types_table(types: list[str], threads: int, repeats: int, rounds: int, isa_mode: str = "best",
                widths: tuple[str, ...] = tuple(WIDTHS)) -> dict:
    """The types section (see the module docstring); one width's experts in memory at a time. Returns every figure
    (width -> type -> m -> seconds, GB/s, fraction of the read rate) and the per-type verdicts."""
    best = native.best_isa()
    path = {"best": best, "default": native.default_isa()}.get(isa_mode, isa_mode)
    print(f"\ntypes: one expert per call, {threads} thread(s), ISA {path} ({isa_mode}; best {best}); GB/s of the "
          f"expert's bytes (quantized), 'of read' against the read rate measured around the figure; TOP/s = 2 m 3HF / time")
    head = (f"{'width':17s} {'type':13s} {'MiB':>6s} {'m':>3s} | {'ms':>8s} {'GB/s':>6s} {'of read':>7s} | "
            f"{'TOP/s':>6s} {'x bf16@avx512':>13s}")
    print(f"{head}\n{'-' * len(head)}", flush=True)
    today_isa = "avx512bf16" if best == "amx" else best
    runs = [(t, path) for t in types] + ([("bf16", today_isa)] if "bf16" in types and path != today_isa else [])
    figures: dict = {"isa": path, "threads": threads, "widths": {}}
    for name in widths:
        H, F = WIDTHS[name]
        fig = Figures()
        experts = {qtype: TypedExperts(H, F, qtype) for qtype in dict.fromkeys(t for t, _ in runs)}
        # every type's figure of one m measured side by side, the order reversed every other round: what the other
        # tenants of a shared machine do to the read rate then falls on each type alike
        for rnd in range(max(rounds, 1)):
            for m in ROWS:
                for qtype, isa in (runs if rnd % 2 == 0 else runs[::-1]):
                    native.set_isa(isa)
                    try:
                        fig.measure((qtype, isa, m), threads,
                                    lambda: experts[qtype].seconds(m, threads, max(repeats, 2)))
                    finally:
                        native.set_isa(None)
        rows: list[tuple] = []
        for qtype, isa in runs:
            ex = experts[qtype]
            label = qtype if qtype == ex.down_type else f"{qtype}/{ex.down_type}"
            rows.append((qtype, isa, label + ("@avx512" if isa != path else ""), ex.bytes))
        del experts
        today = {m: fig.best[("bf16", today_isa, m)] for m in ROWS if ("bf16", today_isa, m) in fig.best}
        width = figures["widths"][name] = {"hidden": H, "inter": F, "types": {}}
        for qtype, isa, label, nbytes in rows:
            cells = width["types"][label] = {"bytes": nbytes, "m": {}}
            for m in ROWS:
                s, gbs, frac = fig.gbs((qtype, isa, m), nbytes)
                cells["m"][m] = {"seconds": s, "gb_s": gbs, "of_read": frac}
                tops = 2 * m * 3 * H * F / s / 1e12
                ratio = f"{today[m] / s:13.2f}" if m in today else f"{'-':>13s}"
                print(f"{name:17s} {label:13s} {nbytes / 2**20:6.1f} {m:3d} | {s * 1e3:8.3f} {gbs:6.1f} {frac:7.0%} | "
                      f"{tops:6.3f} {ratio}", flush=True)
    print("'x bf16@avx512': today's bf16 kernel time (AVX512-BF16 dot products, no AMX) over this row's, same width "
          "and m (higher: faster); K-quant experts at DeepSeek-V2-Lite width take down in the type after the slash")
    figures["verdicts"] = verdicts(figures, types, path)
    return figures


def verdicts(figures: dict, types: list[str], path: str) -> dict:
    """Per type: the lowest fraction of the read rate over the widths at m <= 4 against READ_TARGET, and its time
    per m relative to bf16's (same width, same ISA path) at every width."""
    print(f"\nper type, ISA {path}: the worst 'of read' at m <= 4 over the widths (target >= {READ_TARGET:.0%}); time "
          f"relative to bf16 at the same width and m (m = {', '.join(map(str, ROWS))})")
    out = {}
    for qtype in types:
        worst, rel = math.inf, {}
        for name, width in figures["widths"].items():
            cells = next((v for k, v in width["types"].items() if k.split("/")[0] == qtype and "@" not in k), None)
            base = width["types"].get("bf16")
            if cells is None:
                continue
            worst = min(worst, *(cells["m"][m]["of_read"] for m in ROWS if m <= 4))
            if base is not None:
                rel[name] = [cells["m"][m]["seconds"] / base["m"][m]["seconds"] for m in ROWS]
        met = worst >= READ_TARGET
        out[qtype] = {"worst_of_read_m_le_4": worst, "target_met": met, "time_over_bf16": rel}
        rel_text = "; ".join(f"{w} " + " ".join(f"{r:.2f}" for r in v) for w, v in rel.items())
        print(f"  {qtype:7s} worst {worst:4.0%} -> {'met' if met else 'NOT met'}; x bf16 time: {rel_text}", flush=True)
    return out


def write_json(path: str | None, figures: dict) -> None:
    if path:
        import json

        Path(path).write_text(json.dumps(figures, indent=1) + "\n")
        print(f"figures written to {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--repeats", type=int, default=6, help="timed calls per figure and round (default 6)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="passes over every native figure and read rate, best kept (default 3)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch comparisons")
    ap.add_argument("--no-layer", action="store_true", help="skip the layer tables (host call and XLA FFI)")
    ap.add_argument("--types", default=",".join(TYPES),
                    help=f"weight types of the types section (default {','.join(TYPES)}; empty: skip it)")
    ap.add_argument("--types-only", action="store_true", help="run only the types section")
    ap.add_argument("--isa", choices=("best", "default", "avx512bf16", "avx2", "scalar"), default="best",
                    help="types section: the best ISA path (AMX where present), moescope's default (the same unless "
                         "MOESCOPE_NATIVE_ISA says otherwise) or a named path")
    ap.add_argument("--json", help="types section: write every figure and verdict to this JSON file")
    ap.add_argument("--widths", default=",".join(WIDTHS), help=f"types section: of {', '.join(WIDTHS)}")
    ap.add_argument("--rates-yaml", help="types section: fit the CPU block rates (schedulers/data/block_rates.yaml) "
                                         "at Mixtral width and write them here (needs bf16 among --types)")
    args = ap.parse_args(argv)
    threads_list = [int(t) for t in args.threads.split(",")]
    if not native.available():
        print(f"native kernels unavailable: {native.build_error()}")
        return 1
    types = [t for t in args.types.split(",") if t]
    unknown = sorted(set(types) - set(TYPES))
    if unknown:
        print(f"--types: unknown {unknown}; supported: {', '.join(TYPES)}")
        return 2
    start = time.perf_counter()
    widths = tuple(w for w in args.widths.split(",") if w)
    if not widths or set(widths) - set(WIDTHS):
        print(f"--widths: unknown {sorted(set(widths) - set(WIDTHS))}; known: {', '.join(WIDTHS)}")
        return 2
    if args.rates_yaml and ("bf16" not in types or "mixtral" not in widths):
        print("--rates-yaml: the rates are bf16's at Mixtral width; keep bf16 in --types and mixtral in --widths")
        return 2
    if args.types_only:
        figures = types_table(types, max(threads_list), args.repeats, args.rounds, args.isa, widths)
        write_json(args.json, figures)
        if args.rates_yaml:
            write_rates_yaml(args.rates_yaml, figures, "python -m engine.bench.bench_cpu_experts " + " ".join(argv or sys.argv[1:]))
        print(f"\ntotal {time.perf_counter() - start:.0f} s")
        return 0
    print(f"native ISA: {native.isa()}; weights cycle over distinct experts (~5x the {L3_BYTES >> 20} MiB L3); "
          f"best of {args.repeats} calls x {args.rounds} rounds; GB/s of bf16 weight bytes")
    experts = {name: Experts(h, f, *LAYERS[name]) for name, (h, f) in WIDTHS.items()}
    rates: dict[int, float] = {}
    fig = Figures()
    calls = max(args.repeats, 2)
    ffi: dict[tuple[str, int], FfiLayer] = {}
    if not args.no_layer and native.available_experts():
        ffi = {(name, m): FfiLayer(ex, m, calls) for name, ex in experts.items() for m in LAYER_ROWS}
    for rnd in range(max(args.rounds, 1)):
        for th in threads_list:
            nat, tor = read_rates(th)
            rates[th] = max(rates.get(th, 0.0), nat, tor)
            print(f"round {rnd + 1}: memory read rate, {th} thread(s): native {nat:.1f} GB/s, torch sum {tor:.1f} GB/s",
                  flush=True)
        for name, ex in experts.items():
            for th in threads_list:
                for m in ROWS:
                    fig.measure((name, m, th), th, lambda: time_native(ex, m, th, calls))
                if args.no_layer:
                    continue
                for m in LAYER_ROWS:
                    for st in STRATEGIES if th > 1 else STRATEGIES[:1]:
                        fig.measure((name, m, th, st), th, lambda: time_layer(ex, m, th, calls, st))
                    if (name, m) in ffi:
                        fig.measure((name, m, th, "ffi"), th, lambda: ffi[name, m].seconds(th))
    print("reference read rate (best of the rounds): " +
          ", ".join(f"{th} thread(s) {r:.1f} GB/s" for th, r in rates.items()) +
          "; 'of read' below is against the native read rate measured around each figure's best round")
    head = (f"{'width':17s} {'m':>3s} {'thr':>3s} | {'native ms':>9s} {'GB/s':>6s} {'of read':>7s}"
            + ("" if args.no_torch else f" | {'torch bf16 ms':>13s} {'GB/s':>6s} | {'torch f32 ms':>12s}"
                                         f" {'GB/s':>6s} | {'x bf16':>6s} {'x f32':>6s}"))
    print(f"\n{head}\n{'-' * len(head)}")
    for name, ex in experts.items():
        f32 = None
        if not args.no_torch:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                f32 = [tuple(t.float() for t in w) for w in ex.torch[:3]]  # 3 upcast experts: 2x the bytes
        for th in threads_list:
            for m in ROWS:
                s, gbs, frac = fig.gbs((name, m, th), ex.bytes)
                line = f"{name:17s} {m:3d} {th:3d} | {s * 1e3:9.3f} {gbs:6.1f} {frac:7.0%}"
                if not args.no_torch:
                    tb = time_torch(ex.torch, ex.hidden, m, torch.bfloat16, th, max(2, min(calls, 4)))
                    tf = time_torch(f32, ex.hidden, m, torch.float32, th, max(2, min(calls, 4)))
                    line += (f" | {tb * 1e3:13.3f} {ex.bytes / tb / 1e9:6.1f} | {tf * 1e3:12.3f} "
                             f"{ex.bytes / tf / 1e9:6.1f} | {tb / s:6.1f} {tf / s:6.1f}")
                print(line, flush=True)
        del f32
    print("\n'of read': native GB/s over the native read rate of the same thread count measured just before and "
          "after the figure's calls (the better of the two); 'x bf16' / 'x f32': "
          "torch's time over the native time (higher: native faster; torch timed in one round only)")
    if not args.no_layer:
        print_layers(experts, threads_list, fig, list(ffi.values()))
    if types:
        del experts, ffi
        figures = types_table(types, max(threads_list), args.repeats, args.rounds, args.isa, widths)
        write_json(args.json, figures)
        if args.rates_yaml:
            write_rates_yaml(args.rates_yaml, figures, "python -m engine.bench.bench_cpu_experts " + " ".join(argv or sys.argv[1:]))
    print("\ntiny layer (H 256, F 128, 8 experts x 2 tokens in one call): microseconds per expert")
    for th in threads_list:
        nat, tor = tiny_overhead(th, max(20, args.repeats))
        print(f"  {th} thread(s): native {nat:7.1f} us   torch {tor:7.1f} us   ({tor / nat:.0f}x)")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
