"""Expert Deferral's mechanism (kTransformers, SOSP'25), shared by the simulator and the real executor.

A plan with `defer` = d > 0 at MoE layer l: per token, among its routed (token, slot) pairs whose expert the plan
computes on the CPU, the d with the lowest routing weight are deferred, never the token's highest-weight pair (a token
keeps at least its top expert on time). The CPU computes the layer's other pairs first (the layer waits for them, as
always), then the deferred ones, which the layer does not wait for: their weighted sum is added to the residual with
MoE layer l+1's output. The CPU is one serial lane, so layer l+1's own CPU work starts after them, and layer l+1 ends
no earlier than they do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np

from models.config import ModelConfig


def deferred_pairs(experts: np.ndarray, weights: np.ndarray, cpu: Sequence[int], per_token: int) -> np.ndarray:
    """bool [T, k]: the deferred (token, slot) pairs. experts int [T, k] (-1: routed nowhere), weights float [T, k]."""
    T, k = experts.shape
    if per_token <= 0 or not len(cpu) or T == 0:
        return np.zeros((T, k), bool)
    on_cpu = np.zeros(int(max(experts.max(initial=0), max(cpu))) + 2, bool)  # the last entry is what -1 indexes
    on_cpu[np.asarray(cpu, np.int64)] = True
    w = np.where(experts >= 0, weights.astype(np.float64), -np.inf)
    top = np.argmax(w, axis=1)
    eligible = on_cpu[experts] & (experts >= 0)
    eligible[np.arange(T), top] = False  # a token's highest-weight pair is never deferred
    # rank the eligible pairs of each row by weight, lowest first (ties: the later slot first)
    key = np.where(eligible, w, np.inf)
    order = np.argsort(key[:, ::-1], axis=1, kind="stable")
    order = k - 1 - order
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(k)[None, :].repeat(T, 0), axis=1)
    return eligible & (rank < per_token)


def split_routing(experts: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(immediate experts, deferred experts), each int [T, k] with the other pairs set to -1 (routed nowhere)."""
    return np.where(mask, -1, experts), np.where(mask, experts, -1)


def pair_counts(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 [E]: tokens per expert among the live pairs of `experts` (int [T, k], -1 ignored)."""
    flat = experts.reshape(-1)
    return np.bincount(flat[flat >= 0], minlength=num_experts).astype(np.int64)


class DeferringExperts:
    """The in-memory model's expert executor (`models.moe`, for `models.transformer.forward` run eagerly) with Expert
    Deferral as the offload mechanism applies it: at each MoE layer but the last, the pairs `deferred_pairs` picks
    among the experts `cpu_of(moe_layer)` names (every expert when None: all routed experts on the CPU, kTransformers'
    usual placement and deferral's largest effect) are left out of the layer's output and added to the next MoE
    layer's. The reference of the executor's deferred outputs (tests) and the model whose accuracy
    `engine.bench.bench_deferral` measures. `per_token` 0, or `enabled` False (a prefill), is the exact model."""

    def __init__(self, cfg: ModelConfig, per_token: int, cpu_of: Optional[Callable[[int], Sequence[int]]] = None,
                 base: Any = None):
        from models.moe import DEFAULT_EXECUTOR  # jax: the simulator imports this module's mechanism without it

        self.moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}
        self.last = len(cfg.moe_layers) - 1
        self.every = list(range(cfg.num_experts))
        self.per_token, self.cpu_of, self.base = per_token, cpu_of, DEFAULT_EXECUTOR if base is None else base
        self.enabled = True
        self.pending: Optional[Any] = None  # the last MoE layer's deferred output [T, H]

    def __call__(self, layer: int, x: Any, routing: Any, experts: Any) -> Any:
        import jax.numpy as jnp

        m = self.moe_index[layer]
        cpu = self.every if self.cpu_of is None else list(self.cpu_of(m))
        per_token = self.per_token if self.enabled and m < self.last else 0
        routed = np.asarray(routing.experts).astype(np.int64)
        if routing.valid is not None:
            routed = np.where(np.asarray(routing.valid)[:, None], routed, -1)
        mask = deferred_pairs(routed, np.asarray(routing.weights), cpu, per_token)
        late = jnp.asarray(mask)
        y = self.base(layer, x, dataclasses.replace(routing, weights=jnp.where(late, 0.0, routing.weights)), experts)
        if self.pending is not None:
            y = y + self.pending.astype(y.dtype)
            self.pending = None
        if mask.any():
            deferred = dataclasses.replace(routing, weights=jnp.where(late, routing.weights, 0.0))
            self.pending = self.base(layer, x, deferred, experts)
        return y


__all__ = ["deferred_pairs", "split_routing", "pair_counts", "DeferringExperts"]
