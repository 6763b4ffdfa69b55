"""Speculative expert execution (Madan et al., "Speculating Experts Accelerates Inference for Mixture-of-Experts",
arXiv 2603.19289, 2026) on Fate's GPU-only offloading: at each layer the next layer's experts the distance-1 forecast
names are prefetched (hottest predicted first, LRU cache), and in a decode step a layer whose routed experts are not
all resident or landing does not load the missing ones on demand: it *executes the speculated experts*, those of the
layer that are resident or landing, in place of the router's missing choices (`engine.offload.speculation`: a missed
(token, slot) pair is computed by the first speculated expert the token does not already use, with the router's
weight). The paper's point: a wrong speculation costs accuracy, not a re-fetch on the critical path.

The model's output changes (`tokens_match_in_memory` does not hold): never a default, never in an exact run. Prefill
passes, and layers with fewer than top-k experts at hand (nothing could stand in for a token's experts), run as Fate
does (missing experts loaded on demand). Its accuracy cost: `python -m engine.bench.bench_speculation`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from schedulers.base import LayerPlan, LayerState, Phase, SchedulerSetup, register
from schedulers.offload.fate import Fate, FateSettings


@dataclass(frozen=True)
class SpeculativeSettings(FateSettings):
    """Fate's settings (no knobs of its own: the paper always executes its speculation in decode)."""

    kind: str = "speculative"
    label: str = "SpecExec"
    exact_output: ClassVar[bool] = False  # the model's output changes (the exact-token tests leave it out)


@register("speculative", settings=SpeculativeSettings)
class SpeculativeExecution(Fate):
    def __init__(self, settings: SpeculativeSettings, setup: SchedulerSetup):
        super().__init__(settings, setup)
        self.forecast = np.zeros((self.L, self.E))  # the distance-1 forecast each layer was last given

    def speculation(self, state: LayerState) -> np.ndarray:
        """int [m]: the layer's experts at hand (resident or landing), the router's most weighted first, then the
        forecast's (the order in which they stand in for missed experts)."""
        at_hand = np.flatnonzero(state.available(state.layer))
        key = np.lexsort((at_hand, -self.forecast[state.layer, at_hand], -state.scores[at_hand]))
        return at_hand[key]

    def plan(self, state: LayerState) -> LayerPlan:
        target = state.layer + 1
        if self.settings.use_predictor and target < self.L and target in state.predicted:
            self.forecast[target] = state.predicted[target]
        missing = state.active[~state.available(state.layer)[state.active]]
        spec = self.speculation(state)
        if state.phase is not Phase.decode or not missing.size or spec.size < self.k:
            return super().plan(state)
        gpu = tuple(int(e) for e in spec)
        self.touch(state.layer, gpu)
        prefetch = self.next_layer_prefetch(state)
        granted, evict = self.room_for(state, len(prefetch), {(state.layer, e) for e in gpu})
        prefetch = prefetch[:granted]
        for t, e in prefetch:
            self.last_used[t, e] = self._clock
        return LayerPlan(gpu=gpu, prefetch=tuple(prefetch), evict=tuple(evict), speculate=gpu)
