"""Synthetic routing traces with a known inter-layer rule (tests and benchmarks of the predictors; no model needed)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from core.trace import RoutingTrace, TraceMeta


def shift_rule_trace(rng: np.random.Generator, num_layers: int = 4, num_experts: int = 8, top_k: int = 2,
                     hidden: int = 16, n_seq: int = 24, rows_per_seq: int = 32, shift: int = 1,
                     vocab: int = 512, moe_layers: Optional[tuple[int, ...]] = None, signal: float = 0.0
                     ) -> RoutingTrace:
    """Layer 0 routes at random; layer l > 0 uses the experts of layer l - 1 plus `shift` (mod E).

    One step per sequence; tokens random ids below `vocab`. Gate inputs (float16) are standard
    normal noise plus `signal` times a fixed random embedding of the layer's own chosen experts.
    """
    N = n_seq * rows_per_seq
    experts = np.zeros((num_layers, N, top_k), np.int16)
    experts[0] = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(N)])
    for layer in range(1, num_layers):
        experts[layer] = (experts[layer - 1] + shift) % num_experts
    weights = rng.dirichlet(np.ones(top_k), size=(num_layers, N)).astype(np.float32)
    hidden_states = rng.standard_normal((num_layers, N, hidden))
    if signal:
        embed = rng.standard_normal((num_experts, hidden))
        onehot = np.zeros((num_layers, N, num_experts))
        np.put_along_axis(onehot, experts.astype(np.int64), 1.0, axis=2)
        hidden_states += signal * onehot @ embed
    seq = np.repeat(np.arange(n_seq), rows_per_seq).astype(np.int32)
    pos = np.tile(np.arange(rows_per_seq), n_seq).astype(np.int32)
    meta = TraceMeta(model="synthetic-shift", num_experts=num_experts, top_k=top_k,
                     moe_layers=moe_layers or tuple(range(num_layers)), hidden_size=hidden, source=f"shift={shift}")
    return RoutingTrace(meta=meta, experts=experts, weights=weights, step=seq.copy(), batch=seq.copy(), seq=seq,
                        pos=pos, token=rng.integers(3, vocab, N).astype(np.int32), phase=np.zeros(N, np.int8),
                        hidden=hidden_states.astype(np.float16))
