"""CPU experts: the tokens a plan routes to CPU experts, computed with torch in a worker thread.

Weights come from the `ExpertStore` as zero-copy torch views of the host arrays; tokens are
grouped per expert (one GEMM chain per expert), weighted, and scattered back into the original
token order. The worker thread overlaps with device compute; torch releases the GIL in its kernels.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from engine.offload.store import ExpertStore


class CpuExperts:
    """torch SwiGLU experts over an `ExpertStore`, `threads` intra-op threads, fp32 or bf16 compute.

    One thread by default: the device computation runs beside the worker, and an OpenMP team that
    waits for a core held by another computation stalls for milliseconds (measured: 35 ms instead of
    0.1 ms for a one-token expert on this 2-core machine with 2 torch threads under load).
    """

    def __init__(self, store: ExpertStore, threads: int = 1, dtype: str = "float32"):
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"offload.cpu_dtype: {dtype!r} is not float32 or bfloat16")
        self.store = store
        self.dtype = torch.float32 if dtype == "float32" else torch.bfloat16
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moescope-cpu-experts")
        self._weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.timings: list[tuple[int, float]] = []  # (tokens, seconds) per expert call, for the Timer

    def _expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (layer, expert)
        if key not in self._weights:
            views = self.store.numpy_views(layer, expert)
            with warnings.catch_warnings():  # read-only views: torch warns, and we never write to them
                warnings.simplefilter("ignore", UserWarning)
                tensors = [torch.from_numpy(np.asarray(v)) for v in views]  # zero-copy
            if self.dtype != torch.float32 or tensors[0].dtype != self.dtype:
                tensors = [t.to(self.dtype) for t in tensors]
            self._weights[key] = tuple(tensors)  # type: ignore[assignment]
        return self._weights[key]

    def compute(self, layer: int, x: np.ndarray, experts: np.ndarray, weights: np.ndarray,
                cpu_experts: list[int]) -> np.ndarray:
        """float32 [T, H]: sum over the (token, slot) pairs routed to `cpu_experts` of weight * expert(x)."""
        if self.threads:
            torch.set_num_threads(self.threads)
        xt = torch.from_numpy(np.array(x, dtype=np.float32))
        out = torch.zeros_like(xt)
        # the layer's pairs grouped by expert once (a decode expert is a few torch calls: their count is its cost)
        flat = experts.reshape(-1)
        order = np.argsort(flat, kind="stable")  # by expert, then token (the order index_add_ used before)
        ranked, wanted = flat[order], np.asarray(cpu_experts)
        bounds = np.searchsorted(ranked, wanted, side="left").tolist()
        ends = np.searchsorted(ranked, wanted, side="right").tolist()
        tokens_t = torch.from_numpy(order // experts.shape[1])
        pair_w = torch.from_numpy(weights.reshape(-1)[order].astype(np.float32))
        cast = self.dtype != torch.float32
        for e, lo, hi in zip(cpu_experts, bounds, ends):
            if hi == lo:
                continue
            start = time.perf_counter()
            gate, up, down = self._expert(layer, e)
            tok = tokens_t[lo:hi]
            rows = xt.index_select(0, tok)
            if cast:
                rows = rows.to(self.dtype)
            h = torch.nn.functional.silu(rows @ gate).mul_(rows @ up)
            y = h @ down
            if cast:
                y = y.float()
            out.index_add_(0, tok, y.mul_(pair_w[lo:hi, None]))
            self.timings.append((hi - lo, time.perf_counter() - start))
        return out.numpy()

    def submit(self, layer: int, x: np.ndarray, experts: np.ndarray, weights: np.ndarray,
               cpu_experts: list[int]) -> Future:
        """Run `compute` in the worker thread; the future's result is the float32 [T, H] partial output."""
        return self._pool.submit(self.compute, layer, x, experts, weights, list(cpu_experts))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @staticmethod
    def time_expert(store: ExpertStore, layer: int, expert: int, tokens: int, repeats: int = 5,
                    dtype: str = "float32", seed: int = 0, threads: int = 1) -> Optional[float]:
        """Best-of-`repeats` seconds of one expert on `tokens` random tokens (calibration), after a warm-up call
        (the first one pays torch's lazy set-up: ~2 ms here, 30 times a one-token expert)."""
        cpu = CpuExperts(store, threads=threads, dtype=dtype)
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
