"""LayerScope's ablation "no PreSched": a greedy layer-by-layer split (eq. 1) and a fixed number of
prefetches per layer (§5.3: "reverts to a fixed policy of prefetching exactly two experts per layer,
mimicking HybriMoE"), with LayerScope's hot table and predictor."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schedulers.base import LayerPlan, LayerState, SchedulerSettings, register
from schedulers.policy import OffloadPolicy, by_tokens, split_by_availability


def greedy_split(cur_tokens_sorted: np.ndarray, ready_gpu_s: float, alpha: float, t_io: float, t_g: float,
                 cost) -> int:
    """Eq. 1: i minimising max(T_C, T_G) when E_cur[0..i-1] (ascending) run on the CPU and the rest load.

    T_C(i) = t_c(E_cur[0..i-1]); T_G(i) = max(GPU work on resident experts, alpha + (n - i) t_io) + t_g.
    """
    n1 = len(cur_tokens_sorted)
    tc = np.concatenate([[0.0], np.cumsum(np.atleast_1d(cost.t_c(cur_tokens_sorted)))]) if n1 else np.zeros(1)
    i = np.arange(n1 + 1)
    tg = np.maximum(ready_gpu_s, alpha + (n1 - i) * t_io) + np.where(i < n1, t_g, 0.0)
    return int(np.argmin(np.maximum(tc, tg)))


@dataclass(frozen=True)
class LayerwiseSettings(SchedulerSettings):
    kind: str = "layerwise"
    label: str = "LayerScope w/o PreSched"
    prefetch_count: int = 2  # next-layer prefetches per layer, most predicted tokens first


@register("layerwise", settings=LayerwiseSettings)
class LayerwiseGreedy(OffloadPolicy):
    def plan(self, state: LayerState) -> LayerPlan:
        layer, tokens, cost = state.layer, state.tokens, state.cost
        self.observe_usage(state)
        ready, missing = split_by_availability(state)
        cur = by_tokens(missing, tokens)
        ready_s = float(np.sum(np.atleast_1d(cost.t_g(tokens[ready])))) if ready.size else 0.0
        t_g = float(cost.t_g(max(int(tokens.max(initial=1)), 1)))
        i = greedy_split(tokens[cur].astype(np.float64), ready_s, state.alpha_s, state.t_io_s, t_g, cost)
        loads = cur[i:][::-1]
        gpu = tuple(int(e) for e in ready) + tuple(int(e) for e in loads)
        self.touch(layer, gpu)
        prefetch = self.next_layer_prefetch(state, self.settings.prefetch_count)
        return self.plan_with_slots(state, tuple(int(e) for e in cur[:i]), gpu, tuple(int(e) for e in loads), prefetch)
