"""kTransformers-style static placement (Chen et al., 2025): the hottest experts by profiled
frequency pinned on the GPU until memory is full, every other expert computed in place on the CPU;
no transfers during decode. Prefill passes of at least `prefill_gpu_min_tokens` tokens stream the
missing experts through the GPU staging buffer (long prompts would otherwise put thousands of tokens
per expert on the CPU)."""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.base import LayerPlan, LayerState, Phase, SchedulerSettings, register
from schedulers.policy import OffloadPolicy, by_tokens, split_by_availability


@dataclass(frozen=True)
class KTransformersSettings(SchedulerSettings):
    kind: str = "ktransformers"
    label: str = "kTransformers"
    prefill_gpu_min_tokens: int = 1024  # prefill passes of at least this many tokens run experts on the GPU


@register("ktransformers", settings=KTransformersSettings)
class KTransformersStatic(OffloadPolicy):
    @property
    def dynamic_slots(self) -> int:
        return 0 if self.settings.hot_table else self.setup.cache_slots

    def plan(self, state: LayerState) -> LayerPlan:
        ready, missing = split_by_availability(state)
        gpu = tuple(int(e) for e in ready)
        if state.phase is Phase.prefill and state.batch_tokens >= self.settings.prefill_gpu_min_tokens:
            loads = tuple(int(e) for e in by_tokens(missing, state.tokens, descending=True))
            return LayerPlan(gpu=gpu + loads, ondemand=loads)
        return LayerPlan(cpu=tuple(int(e) for e in missing), gpu=gpu)
