"""Speculative expert execution (Madan et al., arXiv 2603.19289, 2026), shared by the simulator and the real executor.

The experts a forecast named for MoE layer l, fetched while layer l-1 ran, are *executed* at layer l in place of the
router's choice where the two differ, instead of loading the router's missing experts on demand: the output is
approximate. Here the speculation is a set: a plan with `speculate` = S (ordered, first = most likely) at layer l
computes only experts of S. Per token, a routed (token, slot) pair whose expert is in S is computed as routed (a hit);
a pair whose expert is not (a miss) is computed by the first expert of S the token does not already use, with the
router's weight of the missed pair; a miss with no such expert left is dropped (only when S has fewer than k experts).
With one S per token (`speculate` [T, m]) the same rule is the paper's per-token speculation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from engine.offload.deferral import pair_counts
from models.config import ModelConfig
from schedulers.base import LayerPlan

Speculation = Union[Sequence[int], np.ndarray]  # int [m] (one set for every token) or int [T, m] (one per token)


def speculated_routing(experts: np.ndarray, speculate: Speculation) -> np.ndarray:
    """int64 [T, k]: the experts each (token, slot) pair is computed by under speculation `speculate` (module rule).
    experts int [T, k] (-1: routed nowhere, kept -1)."""
    experts = np.asarray(experts, np.int64)
    T, k = experts.shape
    spec = np.asarray(speculate, np.int64)
    spec = np.broadcast_to(spec.reshape(1, -1), (T, spec.size)) if spec.ndim <= 1 else spec
    if spec.shape[0] != T:
        raise ValueError(f"speculate: {spec.shape[0]} rows of speculated experts for {T} tokens")
    m = spec.shape[1]
    live = experts >= 0
    if m == 0:
        return np.full_like(experts, -1)
    hit = (experts[:, :, None] == spec[:, None, :]).any(-1) & live  # [T, k]
    miss = live & ~hit
    unused = ~(spec[:, :, None] == experts[:, None, :]).any(-1)  # [T, m]: speculated experts the token leaves free
    order = np.argsort(~unused, axis=1, kind="stable")  # the free ones first, in S's order
    rank = np.cumsum(miss, axis=1) - 1  # the n-th miss of a row takes its n-th free speculated expert
    take = miss & (rank < unused.sum(1, keepdims=True))
    target = np.take_along_axis(spec, np.take_along_axis(order, np.clip(rank, 0, m - 1), axis=1), axis=1)
    return np.where(take, target, np.where(miss, -1, experts))


def working_plan(plan: LayerPlan, executed: np.ndarray, num_experts: int) -> LayerPlan:
    """The plan the mechanism runs: without the speculated experts no executed pair uses (neither the simulator nor
    the executor waits for one landing, nor calls it). executed int [T, k] from `speculated_routing`."""
    used = pair_counts(executed, num_experts) > 0
    keep = set(plan.ondemand)
    return dataclasses.replace(plan, gpu=tuple(e for e in plan.gpu if used[e] or e in keep),
                               cpu=tuple(e for e in plan.cpu if used[e]))


def hit_share(experts: np.ndarray, speculate: Speculation) -> float:
    """The share of live (token, slot) pairs computed by their routed expert (1.0 with no live pair)."""
    experts = np.asarray(experts, np.int64)
    live = experts >= 0
    same = (speculated_routing(experts, speculate) == experts) & live
    return float(same.sum() / live.sum()) if live.any() else 1.0


class SpeculatingExperts:
    """The in-memory model's expert executor (`models.moe`, run eagerly by `models.transformer.forward`) with the
    paper's per-token speculation applied exactly: at each MoE layer l, layer l+1's router is applied to layer l's
    gate input (the "currently computed internal representations"), and each token's `slots` highest-scoring experts
    of layer l+1 are its speculation there; at layer l+1 the token's routed pairs are replaced by `speculated_routing`
    (the first MoE layer, with no earlier layer to speculate from, is exact). `slots` = top-k is the paper's setting
    (only the speculated experts are fetched); more slots model a cache that holds more of the layer. `sets`: instead,
    one speculation per MoE layer index for every token (`sets(moe_index)` -> ordered experts, or None: exact), the
    reference of a plan's `speculate`. `enabled` False (a prefill) computes exactly. Records the hit share per layer."""

    def __init__(self, model: Any, slots: int = 0, sets: Optional[Any] = None, base: Any = None):
        from models.moe import DEFAULT_EXECUTOR  # jax: the simulator imports this module's rule without it

        cfg: ModelConfig = model.cfg
        self.model, self.base, self.sets = model, DEFAULT_EXECUTOR if base is None else base, sets
        self.moe_layers = list(cfg.moe_layers)
        self.slots = slots or cfg.num_experts_per_tok
        self.enabled = True
        self.pending: Optional[np.ndarray] = None  # int [T, slots]: the speculation made for the next MoE layer
        self.hits: list[float] = []

    def _speculation(self, m: int, T: int) -> Optional[Speculation]:
        if not self.enabled:
            return None
        if self.sets is not None:
            return self.sets(m)
        return self.pending if self.pending is not None and self.pending.shape[0] == T else None

    def _speculate_next(self, m: int, x: Any) -> None:
        """Layer m+1's router on layer m's gate input: each token's `slots` highest-scoring experts, best first."""
        self.pending = None
        if self.sets is not None or m + 1 >= len(self.moe_layers):
            return
        router = self.model.layers[self.moe_layers[m + 1]].moe.router
        logits = np.asarray(router.logits(x))
        self.pending = np.argsort(-logits, axis=1, kind="stable")[:, :self.slots]

    def __call__(self, layer: int, x: Any, routing: Any, experts: Any) -> Any:
        import jax.numpy as jnp

        m = self.moe_layers.index(layer)
        routed = np.asarray(routing.experts).astype(np.int64)
        spec = self._speculation(m, routed.shape[0])
        self._speculate_next(m, x)
        if spec is None:
            return self.base(layer, x, routing, experts)
        computed = speculated_routing(routed, spec)
        self.hits.append(hit_share(routed, spec))
        weights = jnp.where(jnp.asarray(computed >= 0), routing.weights, 0.0)  # a dropped miss contributes nothing
        executed = dataclasses.replace(routing, experts=jnp.asarray(np.maximum(computed, 0), routing.experts.dtype),
                                       weights=weights)
        return self.base(layer, x, executed, experts)


__all__ = ["speculated_routing", "working_plan", "hit_share", "SpeculatingExperts", "Speculation"]
