"""Fate (Fang et al., 2025): GPU-only; at each layer the next layer's experts predicted by its
cross-layer gate (here: the run's predictor) are all prefetched, hottest predicted first, behind
the current layer's on-demand loads; misses load on demand; loaded and prefetched experts live in
the dynamic cache region with least-recently-used eviction (the hot table stays). Transfers
already queued for this layer keep their place (a CUDA stream is FIFO); mispredicted ones are
dropped rather than waited for, which can only help it."""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.base import LayerPlan, LayerState, SchedulerSettings, register
from schedulers.policy import OffloadPolicy, by_tokens, split_by_availability


@dataclass(frozen=True)
class FateSettings(SchedulerSettings):
    """No knobs of its own."""

    kind: str = "fate"
    label: str = "Fate"


@register("fate", settings=FateSettings)
class Fate(OffloadPolicy):
    def plan(self, state: LayerState) -> LayerPlan:
        layer, tokens = state.layer, state.tokens
        ready, missing = split_by_availability(state)
        queued_here = [t.expert for t in state.queued if t.layer == layer and tokens[t.expert] > 0]
        first = set(queued_here)
        rest = [e for e in by_tokens(missing, tokens, descending=True).tolist() if e not in first]
        loads = queued_here + rest
        gpu = tuple(int(e) for e in ready) + tuple(loads)
        self.touch(layer, gpu)
        protect = {(layer, e) for e in gpu}
        prefetch = self.next_layer_prefetch(state)
        granted, evict = self.room_for(state, len(prefetch) + len(loads), protect)
        prefetch = prefetch[:granted]
        keep = max(granted - len(prefetch), 0)
        retain = tuple(i < keep for i in range(len(loads)))
        for t, e in prefetch:
            self.last_used[t, e] = self._clock
        return LayerPlan(gpu=gpu, ondemand=tuple(loads), retain=retain, prefetch=tuple(prefetch), evict=tuple(evict))
