"""LayerScope's ablation "no PreSched": a greedy layer-by-layer split (eq. 1) and a fixed number of
prefetches per layer (§5.3: "reverts to a fixed policy of prefetching exactly two experts per layer,
mimicking HybriMoE"), with LayerScope's hot table and predictor.

`keep_queued_prefetches` makes its issued prefetches non-droppable: one not started by the next plan
point keeps the head of the link (`LayerPlan.hold`) and that layer's on-demand loads queue behind it,
as copies issued on one CUDA stream run in order (HybriMoE's `wait_prefetch`: the shared mechanism
otherwise drops them, and HybriMoE / Fate here only re-list those of the current layer first)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from schedulers.base import LayerPlan, LayerState, SchedulerSettings, register
from schedulers.policy import OffloadPolicy, by_tokens, split_by_availability


_PYTHON_UP_TO = 32  # eq. 1 over at most this many experts runs on Python floats (numpy's per-call overhead dominates)


def greedy_split(cur_tokens_sorted: Sequence[float], ready_gpu_s: float, alpha: float, t_io: float, t_g: float,
                 cost, t_cpu: Optional[Sequence[float]] = None) -> int:
    """Eq. 1: i minimising max(T_C, T_G) when E_cur[0..i-1] (ascending) run on the CPU and the rest load.

    T_C(i) = t_c(E_cur[0..i-1]); T_G(i) = max(GPU work on resident experts, alpha + (n - i) t_io) + t_g.
    `t_cpu`: each expert's `cost.t_c(m)`, in the same order, where the caller has them (the same values).
    """
    n1 = len(cur_tokens_sorted)
    if n1 <= _PYTHON_UP_TO:  # a layer's few missing experts: the same float operations on Python floats, in order
        tc, acc = [0.0], 0.0
        for c in (t_cpu if t_cpu is not None else [cost.t_c(float(m)) for m in cur_tokens_sorted]):
            acc += c  # np.cumsum adds left to right, from the first element
            tc.append(acc)
        best, best_span = 0, math.inf
        for i in range(n1 + 1):  # the first minimum, as np.argmin; max() without its calls (the same values)
            link = alpha + (n1 - i) * t_io
            g = (ready_gpu_s if ready_gpu_s > link else link) + (t_g if i < n1 else 0.0)
            span = tc[i] if tc[i] > g else g
            if span < best_span:
                best, best_span = i, span
        return best
    tc = np.concatenate([[0.0], np.cumsum(np.atleast_1d(cost.t_c(cur_tokens_sorted)))])
    i = np.arange(n1 + 1)
    tg = np.maximum(ready_gpu_s, alpha + (n1 - i) * t_io) + np.where(i < n1, t_g, 0.0)
    return int(np.argmin(np.maximum(tc, tg)))


@dataclass(frozen=True)
class LayerwiseSettings(SchedulerSettings):
    kind: str = "layerwise"
    label: str = "LayerScope w/o PreSched"
    prefetch_count: int = 2  # next-layer prefetches per layer, most predicted tokens first
    keep_queued_prefetches: bool = False  # True: unstarted prefetches are held on the link, loads wait behind them


@register("layerwise", settings=LayerwiseSettings)
class LayerwiseGreedy(OffloadPolicy):
    def plan(self, state: LayerState) -> LayerPlan:
        layer, tokens, cost = state.layer, state.tokens, state.cost
        self.observe_usage(state)
        hold = self.held(state)
        ready, missing = self.split(state, hold)
        cur = by_tokens(missing, tokens)
        ready_s = float(np.sum(np.atleast_1d(cost.t_g(tokens[ready])))) if ready.size else 0.0
        t_g = float(cost.t_g(max(int(tokens.max(initial=1)), 1)))
        alpha = state.alpha_s + len(hold) * state.t_io_s  # the loads start once the held prefetches have moved
        i = greedy_split(tokens[cur].astype(np.float64), ready_s, alpha, state.t_io_s, t_g, cost)
        loads = cur[i:][::-1]
        gpu = tuple(int(e) for e in ready) + tuple(int(e) for e in loads)
        self.touch(layer, gpu)
        prefetch = [p for p in self.next_layer_prefetch(state) if p not in hold][:self.settings.prefetch_count]
        # the held prefetches keep the cache slots they were issued with
        slots = replace(state, free_slots=state.free_slots - len(hold)) if hold else state
        plan = self.plan_with_slots(slots, tuple(int(e) for e in cur[:i]), gpu, tuple(int(e) for e in loads), prefetch)
        return replace(plan, hold=hold) if hold else plan

    def held(self, state: LayerState) -> tuple[tuple[int, int], ...]:
        """The queued prefetches this plan keeps at the head of the link (none unless `keep_queued_prefetches`)."""
        if not self.settings.keep_queued_prefetches:
            return ()
        return tuple((t.layer, t.expert) for t in state.queued)

    @staticmethod
    def split(state: LayerState, hold: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
        """(ready, missing) active experts, those a held prefetch brings counted as ready (they land first)."""
        ready, missing = split_by_availability(state)
        here = [e for target, e in hold if target == state.layer]
        if not here:
            return ready, missing
        coming = np.isin(missing, here)
        return np.concatenate([ready, missing[coming]]), missing[~coming]
