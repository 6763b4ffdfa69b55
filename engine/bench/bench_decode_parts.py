"""A GGUF file's batch-1 decode matrices through several builds of the native library, alternated: where the step goes.

    python -m engine.bench.bench_decode_parts MODEL.gguf OLD.so NEW.so                  # wall time, 2 threads
    python -m engine.bench.bench_decode_parts MODEL.gguf NEW.so NEW.so@l2 --clock cpu   # one build, prefetch levels

One decoder layer's block-quantized matrices as a batch-1 decode step reads them, on the file's own bytes (views of
the mapped file): the attention projections (each its own call, as `QuantLinear` makes them), `--top-k` routed experts
in one `ms_qexperts` call (expert pairs alternating round by round, so that no expert's bytes are still cached), the LM
head (`output.weight`, else the tied embedding), then a streaming read of 256 MiB on the same threads: the machine's
read rate measured right there. Each LIB is a built `moescope_native-*.so` (build the old source once and keep its
file), optionally `@l1` / `@l2` / `@off`: its block kernels' prefetch level (`models.native.set_qprefetch`; a build
without it refuses). Every round runs every library once, the order rotated and reversed round by round, so load on a
shared machine falls on all alike; per part: the median time and GB/s of its bytes, and per library against the first
the median and quartiles of the per-round speed ratios. `--clock cpu` takes process CPU time instead of wall time: a
thread preempted by other work costs nothing (a helper's idle wait, too: what it does not see is imbalance between the
threads). The outputs of the libraries are compared (head and experts: the same bits expected). Prints; asserts
nothing. A step of the served model adds XLA's own work (norms, attention core, routing, sampling) and the FFI calls.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from models import native
from models.gguf import GGUFFile
from models.quant.blocks import QuantArray

ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output")
READ_BYTES = 256 << 20


def open_build(spec: str) -> tuple[str, ctypes.CDLL]:
    """(label, library) of `PATH[@level]` on the AVX-512 (VNNI) path."""
    path, _, level = spec.partition("@")
    lib = ctypes.CDLL(path)
    native._declare(lib)
    if lib.ms_set_isa(b"avx512bf16") != 0:
        raise SystemExit(f"{path}: no AVX-512 path on this CPU")
    if level:
        if not hasattr(lib, "ms_set_qprefetch") or lib.ms_set_qprefetch(level.encode()) != 0:
            raise SystemExit(f"{path}: cannot set prefetch level {level!r}")
    label = Path(path).stem.replace("moescope_native-", "")[:12]
    if hasattr(lib, "ms_qprefetch"):
        label += f"@{lib.ms_qprefetch().decode()}"
    return label, lib


def quant(f: GGUFFile, name: str, expert: int | None = None) -> QuantArray:
    """Tensor `name` (expert `expert` of a stacked one) as a `QuantArray` view of the mapped file."""
    rows = f.block_rows(name)
    shape = f.shape(name)
    if expert is not None:
        rows, shape = rows[expert], shape[1:]
    return QuantArray(rows.reshape(shape[0], -1), f.type_name(name).lower(), tuple(shape))


def layer_parts(f: GGUFFile, layer: int, top_k: int) -> tuple[dict[str, QuantArray], native.ExpertWeights, int]:
    """The layer's attention matrices by name, its packed experts and their count."""
    attn = {n: quant(f, f"blk.{layer}.{n}.weight") for n in ATTENTION if f"blk.{layer}.{n}.weight" in f.tensors}
    names = [f"blk.{layer}.ffn_{k}_exps.weight" for k in ("gate", "up", "down")]
    if any(n not in f.tensors for n in names):
        raise SystemExit(f"{f.path}: layer {layer} has no stacked expert tensors")
    E = f.shape(names[0])[0]
    if E < 2 * top_k:
        raise SystemExit(f"{f.path}: {E} experts; alternating pairs need at least {2 * top_k}")
    experts = native.pack_experts(*([quant(f, n, e) for e in range(E)] for n in names))
    return attn, experts, E


def timed_step(lib: ctypes.CDLL, parts: list[tuple[str, Callable[[ctypes.CDLL], object]]], clock: Callable[[], float]
               ) -> dict[str, float]:
    out = {}
    for name, fn in parts:
        t = clock()
        fn(lib)
        out[name] = clock() - t
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("libs", nargs="+", help="builds of the native library, PATH[@l1|@l2|@off]")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    a = ap.parse_args(argv)
    builds = dict(open_build(s) for s in a.libs)
    if len(builds) != len(a.libs):
        raise SystemExit("two LIBs with the same label: copy a build under another name")
    f = GGUFFile(a.gguf)
    attn, experts, E = layer_parts(f, a.layer, a.top_k)
    head = quant(f, "output.weight" if "output.weight" in f.tensors else "token_embd.weight")
    H, k = head.shape[1], a.top_k
    x = np.random.default_rng(0).standard_normal((1, H)).astype(np.float32)
    read_buf = np.ones(READ_BYTES // 8)
    pairs = [np.arange(k, dtype=np.int64), np.arange(k, 2 * k, dtype=np.int64)]  # the experts of even / odd rounds

    def experts_call(lib: ctypes.CDLL, chosen: np.ndarray) -> np.ndarray:
        offsets = np.zeros(E + 1, np.int64)
        offsets[chosen + 1] = 1
        y = np.zeros((1, H), np.float32)
        native._qexperts_host(lib, y, x, experts, np.cumsum(offsets), np.zeros(k, np.int32), np.ones(k, np.float32),
                              a.threads, None, "auto")
        return y

    def parts_of(r: int) -> list[tuple[str, Callable[[ctypes.CDLL], object]]]:
        ps: list = [(n, lambda lib, w=w: native._qlinear_host(lib, x, w, a.threads)) for n, w in attn.items()]
        ps.append(("experts", lambda lib: experts_call(lib, pairs[r % 2])))
        ps.append(("head", lambda lib: native._qlinear_host(lib, x, head, a.threads)))
        ps.append(("read", lambda lib: lib.ms_read(read_buf.ctypes.data, read_buf.nbytes, a.threads)))
        return ps

    expert_bytes = k * (experts.arrays[0][0].data.nbytes + experts.arrays[1][0].data.nbytes
                        + experts.arrays[2][0].data.nbytes)
    nbytes = {**{n: w.data.nbytes for n, w in attn.items()}, "experts": expert_bytes, "head": head.data.nbytes,
              "read": read_buf.nbytes}
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    names = list(builds)
    res: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in (order if (r // len(names)) % 2 == 0 else order[::-1]):
            res[n].append(timed_step(builds[n], parts_of(r), clock))
    step = [p for p in nbytes if p != "read"]
    print(f"{f.path.name}, layer {a.layer}: {a.threads} thread(s), {a.rounds} rounds, {a.clock} clock; "
          f"load average {os.getloadavg()[0]:.2f}")
    for n in names:
        print(f"{n}")
        for p in nbytes:
            v = np.array([s[p] for s in res[n]])
            print(f"  {p:12s} {nbytes[p] / 1e6:7.1f} MB  median {np.median(v) * 1e3:6.2f} ms  "
                  f"{nbytes[p] / np.median(v) / 1e9:5.1f} GB/s (best {nbytes[p] / v.min() / 1e9:5.1f})")
        v = np.array([sum(s[p] for p in step) for s in res[n]])
        print(f"  {'step':12s} {sum(nbytes[p] for p in step) / 1e6:7.1f} MB  median {np.median(v) * 1e3:6.2f} ms  "
              f"{sum(nbytes[p] for p in step) / np.median(v) / 1e9:5.1f} GB/s")
    for n in names[1:]:
        cells = []
        for p in step + ["step"]:
            get = (lambda s: sum(s[q] for q in step)) if p == "step" else (lambda s, p=p: s[p])
            q = np.array([get(s0) / get(s1) for s0, s1 in zip(res[names[0]], res[n])])
            cells.append(f"{p} {np.median(q):.3f} ({np.percentile(q, 25):.3f}-{np.percentile(q, 75):.3f})")
        print(f"speed {n} / {names[0]}: " + ", ".join(cells))
    ys = {n: (native._qlinear_host(lib, x, head, a.threads), experts_call(lib, pairs[0])) for n, lib in builds.items()}
    same = all(np.array_equal(ys[names[0]][i], ys[n][i]) for n in names for i in (0, 1))
    print(f"outputs (head, experts) identical across the builds: {same}")


if __name__ == "__main__":
    main()
