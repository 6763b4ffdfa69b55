"""CPU experts: the tokens a plan routes to CPU experts, computed on the host in a worker thread.

Weights are the `ExpertStore`'s own arrays (zero-copy: views of the mapped checkpoint, in its dtype).
A layer's (token, slot) pairs are grouped by expert once, and every CPU expert of the layer runs in
one call of moescope's native kernels (`models.native.experts_host`: bf16 or f32 weights, f32
accumulation, the weighted scatter into the token rows), which streams each expert's weights once at
memory bandwidth and costs no per-expert Python. Where the native library is unavailable, torch runs
the same experts one by one (`F.linear` on the [out, in] weights). The worker thread overlaps with
device compute; both paths release the GIL while they compute. Quantized experts (a store of block bytes) run
in the same one native call (`experts_host` over the blocks, Q8 activations as llama.cpp's); block types the
kernels do not read run dequantized, one by one (`models.quant.matmul.host_expert`). torch is imported only by
those fallbacks: with the native library a serving process never loads it (~0.12 GB of anonymous memory).
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

import ml_dtypes
import numpy as np

from engine.offload.store import ExpertStore
from models import native
from models.quant.matmul import host_expert

if TYPE_CHECKING:
    import torch


def torch_view(arr: np.ndarray) -> torch.Tensor:
    """A zero-copy torch tensor over a (possibly read-only) numpy array; bf16 through its int16 bits."""
    import torch

    with warnings.catch_warnings():  # read-only views (mapped files): torch warns, and we never write to them
        warnings.simplefilter("ignore", UserWarning)
        if arr.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)


class CpuExperts:
    """SwiGLU experts over an `ExpertStore` on `threads` host threads, in the store's dtype.

    One thread by default: the device computation runs beside the worker, and on a 2-core machine a
    second CPU thread would take the core the device side needs.
    """

    def __init__(self, store: ExpertStore, threads: int = 1):
        self.store = store
        self.threads = max(int(threads), 1)
        self.native = native.available()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moescope-cpu-experts")
        self._layers: dict[int, native.ExpertWeights] = {}  # every expert of a layer, validated once
        self.timings: list[tuple[int, float]] = []  # (tokens, seconds) per expert computed, for the Timer

    def _layer(self, layer: int) -> native.ExpertWeights:
        """The layer's experts packed for the native call (views of the store: nothing is read or copied)."""
        if layer not in self._layers:
            view = self.store.quant_views if self.store.quantized else self.store.numpy_views
            self._layers[layer] = native.pack_experts(*zip(*(view(layer, e) for e in range(self.store.num_experts))))
        return self._layers[layer]

    def _dequantizing(self, layer: int) -> bool:
        """Whether this layer's quantized experts run dequantized (block types the native kernels do not read,
        or no native library)."""
        if not self.store.quantized:
            return False
        fmt = self.store.formats[layer]
        return not (self.native and native.reads_blocks(fmt.gate_up, fmt.down))

    def compute(self, layer: int, x: np.ndarray, experts: np.ndarray, weights: np.ndarray,
                cpu_experts: list[int]) -> np.ndarray:
        """float32 [T, H]: sum over the (token, slot) pairs routed to `cpu_experts` of weight * expert(x).

        x [T, H] (any float dtype; cast to the weights' dtype), experts int [T, k] (-1: routed nowhere),
        weights float [T, k]. Experts are added in ascending id, as the in-memory model adds them."""
        T, k = experts.shape
        E = self.store.num_experts
        out = np.zeros((T, self.store.cfg.hidden_size), np.float32)
        flat = experts.reshape(-1)
        on_cpu = np.zeros(E + 1, bool)  # the extra entry is what -1 (routed nowhere) indexes
        on_cpu[np.asarray(cpu_experts, np.int64)] = True
        live = np.flatnonzero(on_cpu[flat])
        if not live.size:
            return out
        pairs = live[np.argsort(flat[live], kind="stable")]  # by expert, then token
        counts = np.bincount(flat[pairs], minlength=E)
        tokens = (pairs // k).astype(np.int32)
        pair_w = weights.reshape(-1)[pairs].astype(np.float32)
        used = np.flatnonzero(counts)
        if self._dequantizing(layer):  # f32 activations, as the device's dequantizing experts take them
            self._quantized(out, layer, np.asarray(x, np.float32), used, counts[used], tokens, pair_w)
            return out
        # the kernels quantize the activations of block-type experts themselves (as the in-memory model's do)
        dtype = np.float32 if self.store.quantized else self.store.dtype
        xs = np.ascontiguousarray(np.asarray(x).astype(dtype, copy=False))
        if self.native:  # every expert of the layer passed, the unused ones with no pairs (never read)
            seconds = np.zeros(E, np.float64)
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            native.experts_host(out, xs, self._layer(layer), None, None, offsets, tokens, pair_w, self.threads,
                                seconds=seconds)
            listed = [e for e in dict.fromkeys(int(e) for e in cpu_experts) if counts[e]]  # the plan's order
            self.timings += [(int(counts[e]), float(seconds[e])) for e in listed]
        else:
            views = [self.store.numpy_views(layer, int(e)) for e in used]
            self._torch(out, xs, views, np.concatenate([[0], np.cumsum(counts[used])]), tokens, pair_w)
        return out

    def _quantized(self, out: np.ndarray, layer: int, x: np.ndarray, used: np.ndarray, counts: np.ndarray,
                   tokens: np.ndarray, pair_w: np.ndarray) -> None:
        """Quantized experts one by one (`host_expert`), each weighted output added into its token rows."""
        start_pair = 0
        for e, n in zip(used, counts):
            start = time.perf_counter()
            idx = tokens[start_pair:start_pair + n]
            y = host_expert(x[idx], *self.store.quant_views(layer, int(e)))
            np.add.at(out, idx, y * pair_w[start_pair:start_pair + n, None])
            start_pair += n
            self.timings.append((int(n), time.perf_counter() - start))

    def _torch(self, out: np.ndarray, xs: np.ndarray, views: list, offsets: np.ndarray, tokens: np.ndarray,
               pair_w: np.ndarray) -> None:
        """The fallback: one expert at a time with torch (no native library)."""
        import torch

        torch.set_num_threads(self.threads)
        out_t, x_t = torch.from_numpy(out), torch_view(xs)
        tok_t, w_t = torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(pair_w)
        for (gate, up, down), a, b in zip(views, offsets[:-1], offsets[1:]):
            start = time.perf_counter()
            idx = tok_t[a:b]
            rows = x_t.index_select(0, idx)
            h = torch.nn.functional.silu(torch.nn.functional.linear(rows, torch_view(gate)))
            h = h.mul_(torch.nn.functional.linear(rows, torch_view(up)))
            y = torch.nn.functional.linear(h, torch_view(down)).float()
            out_t.index_add_(0, idx, y.mul_(w_t[a:b, None]))
            self.timings.append((int(b - a), time.perf_counter() - start))

    def submit(self, layer: int, x: np.ndarray, experts: np.ndarray, weights: np.ndarray,
               cpu_experts: list[int]) -> Future:
        """Run `compute` in the worker thread; the future's result is the float32 [T, H] partial output."""
        return self._pool.submit(self.compute, layer, x, experts, weights, list(cpu_experts))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @staticmethod
    def time_expert(store: ExpertStore, layer: int, expert: int, tokens: int, repeats: int = 5, seed: int = 0,
                    threads: int = 1) -> Optional[float]:
        """Best-of-`repeats` seconds of one expert on `tokens` random tokens (calibration), after a warm-up call."""
        cpu = CpuExperts(store, threads=threads)
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((tokens, store.cfg.hidden_size)).astype(np.float32)
        experts = np.full((tokens, 1), expert)
        weights = np.ones((tokens, 1), np.float32)
        best = None
        cpu.compute(layer, x, experts, weights, [expert])
        for _ in range(repeats):
            t = time.perf_counter()
            cpu.compute(layer, x, experts, weights, [expert])
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        cpu.close()
        return best
