"""On-demand loading (Lina, ExpertFlow style): every expert runs on the GPU; the hot table stays
resident and every miss is loaded when its layer needs it, hottest first, through the staging
buffer. No prediction, no prefetch, no CPU."""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.base import LayerPlan, LayerState, SchedulerSettings, register
from schedulers.policy import OffloadPolicy, by_tokens, gpu_only_plan, split_by_availability


@dataclass(frozen=True)
class OnDemandSettings(SchedulerSettings):
    """No knobs of its own."""

    kind: str = "ondemand"
    label: str = "On-demand"


@register("ondemand", settings=OnDemandSettings)
class OnDemand(OffloadPolicy):
    @property
    def dynamic_slots(self) -> int:
        return 0 if self.settings.hot_table else self.setup.cache_slots

    def plan(self, state: LayerState) -> LayerPlan:
        _, missing = split_by_availability(state)
        return gpu_only_plan(state, by_tokens(missing, state.tokens, descending=True))
