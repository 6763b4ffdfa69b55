"""Fiddler (Kamahori et al., ICLR 2025), as efeslab/fiddler's `mixtral.py` behaves: the most popular
experts placed on the GPU to fill its memory, fixed for the run; per layer each activated expert
runs on the GPU if resident, otherwise where it is cheaper: on the CPU (cost growing with its
tokens) or copied into a GPU staging buffer (cost = the transfer). Its exhaustive search over the
2^E placements minimises the *sum* of per-expert costs, so the choice is per expert. No prefetch;
loaded experts are not kept. GPU experts run in expert-id order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schedulers.base import LayerPlan, LayerState, SchedulerSettings, register
from schedulers.policy import OffloadPolicy, split_by_availability


@dataclass(frozen=True)
class FiddlerSettings(SchedulerSettings):
    """No knobs of its own."""

    kind: str = "fiddler"
    label: str = "Fiddler"


@register("fiddler", settings=FiddlerSettings)
class Fiddler(OffloadPolicy):
    @property
    def dynamic_slots(self) -> int:
        return 0 if self.settings.hot_table else self.setup.cache_slots

    def plan(self, state: LayerState) -> LayerPlan:
        tokens, cost = state.tokens, state.cost
        ready, missing = split_by_availability(state)
        m = tokens[missing]
        on_cpu = np.atleast_1d(cost.t_c(m)) < state.t_io_s + np.atleast_1d(cost.t_g(m))
        cpu = tuple(int(e) for e in missing[on_cpu])
        loads = tuple(int(e) for e in np.sort(missing[~on_cpu]))
        gpu = tuple(sorted(int(e) for e in ready)) + loads
        return LayerPlan(cpu=cpu, gpu=gpu, ondemand=loads)
