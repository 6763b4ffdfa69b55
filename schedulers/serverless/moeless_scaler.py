"""MoEless Expert Scaler (MoEless §4.2, Algorithm 1): replicate stragglers until the loads balance.

Every expert starts with one replica. While the coefficient of variation of the per-replica loads
exceeds the threshold V and the per-layer memory cap allows one more replica, the expert whose
replicas carry the highest load (a max-heap) gets one more replica and its load is split evenly
over all its replicas.

The CV is taken over the multiset of replica loads W_l (Algorithm 1 lines 4-6 remove the
straggler's replica loads from W_l and add back R+1 equal shares). Its sum stays the total load,
so the CV is updated in O(1) per step from the running sum of squares.

Memory: the paper loops `while M_alloc < M_cap`; we add a replica only if it fits
(`M_alloc + M_e <= M_cap`), so the cap is never exceeded. The two agree whenever M_cap is a
multiple of M_e. `max_total_replicas` (the slots the devices offer) caps the count as well.
"""

from __future__ import annotations

import heapq
import math
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class ScalingResult:
    counts: np.ndarray  # int64 [E]: replicas per expert, each >= 1
    cv: float  # CV of the replica loads after scaling
    hit_cap: bool  # stopped by the memory cap (or the slot limit) with CV still above V
    added_bytes: float  # M_alloc: memory of the replicas added beyond one per expert


def _cv(total: float, sum_sq: float, n: int) -> float:
    if n == 0 or total <= 0:
        return 0.0
    mean = total / n
    var = max(sum_sq / n - mean * mean, 0.0)
    return math.sqrt(var) / mean


def scale_replicas(loads: np.ndarray, cv_threshold: float, expert_bytes: float, memory_cap_bytes: float,
                   max_total_replicas: Optional[int] = None, max_replicas_per_expert: Optional[int] = None
                   ) -> ScalingResult:
    """Algorithm 1 on one layer.

    loads: float [E] predicted tokens per expert (W_l); cv_threshold: V; expert_bytes: M_e;
    memory_cap_bytes: M_cap, the memory the added replicas of this layer may take;
    max_total_replicas: at most this many replicas in all (device slots); max_replicas_per_expert:
    optional bound on R_e (None: unbounded, as in the paper).
    """
    w = np.asarray(loads, dtype=np.float64).reshape(-1).tolist()  # plain floats: this runs per layer per iteration
    if not w:
        raise ValueError("scale_replicas: loads is empty")
    if not all(v >= 0 and math.isfinite(v) for v in w):
        raise ValueError(f"scale_replicas: loads must be finite and >= 0, got {w}")
    if cv_threshold < 0:
        raise ValueError(f"scale_replicas: cv_threshold (V) must be >= 0, got {cv_threshold}")
    if expert_bytes <= 0:
        raise ValueError(f"scale_replicas: expert_bytes (M_e) must be > 0, got {expert_bytes}")
    E = len(w)
    if max_total_replicas is not None and max_total_replicas < E:
        raise ValueError(f"scale_replicas: {max_total_replicas} replica slots cannot hold one replica of each "
                         f"of {E} experts")
    allowed = (memory_cap_bytes + 1e-9) / expert_bytes  # added replicas that fit the memory cap
    max_n = E + int(allowed) if math.isfinite(allowed) else sys.maxsize
    if max_total_replicas is not None:
        max_n = min(max_n, max_total_replicas)
    counts = [1] * E
    total = sum(w)
    sum_sq = sum(v * v for v in w)
    n = E
    heap = [(-v, e) for e, v in enumerate(w)]  # (-load per replica, expert): ties -> lowest expert id
    heapq.heapify(heap)
    # CV > V  <=>  var > V^2 mean^2  <=>  n * sum_sq > (1 + V^2) * total^2: no sqrt or division per step
    bound = (1.0 + cv_threshold * cv_threshold) * total * total
    hit_cap = False
    while n * sum_sq > bound:
        if n >= max_n:
            hit_cap = True
            break
        _, e = heapq.heappop(heap)
        r = counts[e]
        if max_replicas_per_expert is not None and r >= max_replicas_per_expert:
            if not heap:
                hit_cap = True
                break
            # this straggler cannot grow: drop it from the candidates (its loads stay in the CV)
            continue
        sq = w[e] * w[e]
        sum_sq += sq / (r + 1) - sq / r
        counts[e] = r + 1
        n += 1
        heapq.heappush(heap, (-w[e] / (r + 1), e))
    cv = _cv(total, sum_sq, n)
    return ScalingResult(counts=np.asarray(counts, dtype=np.int64), cv=cv, hit_cap=hit_cap,
                         added_bytes=(n - E) * expert_bytes)
