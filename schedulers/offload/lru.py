"""mixtral-offloading (Eliseev & Mazur, 2023): a per-layer LRU expert cache of fixed size, no
prefetch, every expert on the GPU. Each layer owns an equal share of the cache (started with its
hottest experts when the hot table is on); a miss is loaded and cached, evicting the layer's least
recently used expert that the current layer does not need."""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.base import LayerPlan, LayerState, SchedulerSettings, register
from schedulers.policy import OffloadPolicy, by_tokens, split_by_availability


@dataclass(frozen=True)
class LRUSettings(SchedulerSettings):
    """No knobs of its own."""

    kind: str = "lru"
    label: str = "LRU"


@register("lru", settings=LRUSettings)
class PerLayerLRU(OffloadPolicy):
    per_layer_cache = True

    def plan(self, state: LayerState) -> LayerPlan:
        layer = state.layer
        ready, missing = split_by_availability(state)
        loads = [int(e) for e in by_tokens(missing, state.tokens, descending=True)]
        gpu = [int(e) for e in ready] + loads
        self.touch(layer, gpu)
        room = self.layer_room(state, layer)
        victims = self.layer_victims(state, layer, max(len(loads) - room, 0), set(gpu), self.last_used[layer])
        keep = min(len(loads), max(room, 0) + len(victims))
        return LayerPlan(gpu=tuple(gpu), ondemand=tuple(loads), retain=tuple(i < keep for i in range(len(loads))),
                         evict=tuple(victims))
