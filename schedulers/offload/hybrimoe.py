"""HybriMoE (Zhong et al., 2025), as its public code behaves (PKU-SEC-Lab/HybriMoE, ktransformers
`KExpertsCache` / `KScoreAwareCache`), with LayerScope's shared transfer path and hot-table start:

- per-layer expert slots (an equal share of the cache per layer), started with each layer's
  hottest experts; a miss loads into the layer's slots, evicting the expert of lowest priority
  score, S = a * score + (1 - a) * S over the layer's top-2k scored experts (others decay by 1 - a);
- decode: the hybrid scheduling strategy (HSS): experts sorted cached-first then by tokens
  (descending); the GPU takes from the front, the CPU from the back, whichever side finishes
  earlier with the candidate, the GPU side waiting for its transfers (`move`) as it queues them;
- prefill: every expert on the GPU (misses through the staging buffer once the layer's slots are full);
- prefetch after the current layer's loads: a fixed number (`prefetch_count`) of the next layer's
  top-scored experts, scored by the gate prediction (the predictor) when one is given, else by S.
  Transfers already queued for this layer run first (its `wait_prefetch` semantics: no cancellation);
  mispredicted ones are dropped rather than waited for, which can only help it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schedulers.base import LayerPlan, LayerState, Phase, SchedulerSettings, SchedulerSetup, register
from schedulers.policy import OffloadPolicy, by_tokens, split_by_availability


def hybrid_scheduling(cached: np.ndarray, uncached: np.ndarray, tokens: np.ndarray, t_io: float, cost,
                      alpha: float = 0.0) -> tuple[list[int], list[int]]:
    """HSS: (cpu experts in assignment order, gpu experts in assignment order)."""
    order = np.concatenate([by_tokens(cached, tokens, descending=True), by_tokens(uncached, tokens, descending=True)])
    m = tokens[order]
    t_gpu = np.atleast_1d(cost.t_g(m)).tolist()
    t_cpu = np.atleast_1d(cost.t_c(m)).tolist()
    is_move = np.isin(order, uncached).tolist()
    order = order.tolist()
    gpu_total = cpu_total = 0.0
    move_total = alpha
    gpu: list[int] = []
    cpu: list[int] = []
    lo, hi = 0, len(order) - 1
    while lo <= hi:
        gpu_time = t_gpu[lo]
        cpu_time = t_cpu[hi]
        move = is_move[lo]
        if move and move_total + t_io > gpu_total:
            gpu_time += move_total + t_io - gpu_total
        if gpu_total + gpu_time <= cpu_total + cpu_time:
            gpu.append(order[lo])
            gpu_total += gpu_time
            if move:
                move_total += t_io
            lo += 1
        else:
            cpu.append(order[hi])
            cpu_total += cpu_time
            hi -= 1
    return cpu, gpu


@dataclass(frozen=True)
class HybriMoESettings(SchedulerSettings):
    kind: str = "hybrimoe"
    label: str = "HybriMoE"
    prefetch_count: int = 2  # next-layer experts prefetched per decode layer
    score_ema: float = 0.5  # S = a * score + (1 - a) * S (KScoreAwareCache alpha)


@register("hybrimoe", settings=HybriMoESettings)
class HybriMoE(OffloadPolicy):
    per_layer_cache = True
    resident_on_device = False  # its greedy split may hand the least-loaded resident experts to the CPU

    def __init__(self, settings: HybriMoESettings, setup: SchedulerSetup):
        super().__init__(settings, setup)
        self.priority = np.zeros((self.L, self.E))

    def _update_scores(self, state: LayerState) -> None:
        a = self.settings.score_ema
        mean_score = state.scores / max(state.batch_tokens, 1)
        p = min(2 * self.k, self.E)
        top = np.argsort(-mean_score, kind="stable")[:p]
        top = top[mean_score[top] > 0]
        mask = np.zeros(self.E, dtype=bool)
        mask[top] = True
        row = self.priority[state.layer]
        row[mask] = a * mean_score[mask] + (1 - a) * row[mask]
        row[~mask] *= 1 - a

    def _place(self, state: LayerState, layer: int, experts: list[int], protect: set[int],
               evicted: list[tuple[int, int]]) -> list[bool]:
        """Cache each expert in `layer`'s slots if room can be made (lowest priority evicted)."""
        room = self.layer_room(state, layer, sum(1 for lay, _ in evicted if lay == layer))
        short = len(experts) - max(room, 0)
        if short > 0:
            gone = {x for lay, x in evicted if lay == layer}
            victims = self.layer_victims(state, layer, short, protect | gone, self.priority[layer])
            evicted.extend(victims)
            room = max(room, 0) + len(victims)
        return [i < room for i in range(len(experts))]

    def plan(self, state: LayerState) -> LayerPlan:
        layer, tokens = state.layer, state.tokens
        self._update_scores(state)
        ready, missing = split_by_availability(state)
        if state.phase is Phase.prefill:
            cpu, gpu_order = [], [int(e) for e in ready] + [int(e) for e in by_tokens(missing, tokens, descending=True)]
        else:
            cpu, gpu_order = hybrid_scheduling(ready, missing, tokens, state.t_io_s, state.cost)
        missing_set = set(int(e) for e in missing)
        queued_first = {t.expert for t in state.queued if t.layer == layer}
        loads = [e for e in gpu_order if e in missing_set]
        loads = [e for e in loads if e in queued_first] + [e for e in loads if e not in queued_first]
        gpu = [e for e in gpu_order if e not in missing_set] + loads
        self.touch(layer, gpu)
        evicted: list[tuple[int, int]] = []
        retain = self._place(state, layer, loads, set(gpu), evicted)
        prefetch: list[tuple[int, int]] = []
        target = layer + 1
        if state.phase is Phase.decode and target < state.num_layers and self.settings.prefetch_count > 0:
            if self.settings.use_predictor and target in state.predicted:
                score = state.predicted[target]
            else:
                score = self.priority[target]
            top = by_tokens(np.arange(self.E), score, descending=True)[:self.settings.prefetch_count]
            top = [int(e) for e in top if score[e] > 0 and not state.available(target)[e]]
            placed = self._place(state, target, top, set(), evicted)
            prefetch = [(target, e) for e, ok in zip(top, placed) if ok]
        return LayerPlan(cpu=tuple(cpu), gpu=tuple(gpu), ondemand=tuple(loads), retain=tuple(retain),
                         prefetch=tuple(prefetch), evict=tuple(evicted))
