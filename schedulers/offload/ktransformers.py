"""kTransformers (Chen et al., SOSP'25) in LayerScope's setting: the hottest experts by profiled frequency pinned on the
GPU until memory is full, every other expert computed in place on the CPU; no transfers during decode. Prefill passes
of at least `prefill_gpu_min_tokens` tokens stream the missing experts through the GPU staging buffer (long prompts
would otherwise put thousands of tokens per expert on the CPU).

**Expert Deferral** (`max_deferred_per_token`, kTransformers' `--kt-max-deferred-experts-per-token`; 0, off, in
`ktransformers.yaml`, 1 in `ktransformers_deferral.yaml`): in a decode step, per token, up to that many of its
lowest-weight routed experts that run on the CPU (never its highest-weight one) are deferred: their output is added to
the residual one MoE layer late, with the next MoE layer's output, so the CPU computes them while the GPU runs the
next layer's attention and GPU experts instead of idling at the layer's end (the paper: CPU utilisation from under
75 % to nearly 100 %, up to 1.45x decode throughput, a mean accuracy drop under 0.5 % on its benchmarks). The last MoE
layer defers nothing (no later layer to land in). The model's output changes: `tokens_match_in_memory` does not hold
with it; its accuracy cost is measured by `python -m engine.bench.bench_deferral`. The mechanism
(`engine.offload.deferral`: which (token, slot) pairs are deferred, the simulator's CPU lane and the executor's
deferred partial output) is shared; this module only says how many.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.base import LayerPlan, LayerState, Phase, SchedulerSettings, register
from schedulers.policy import OffloadPolicy, by_tokens, split_by_availability


@dataclass(frozen=True)
class KTransformersSettings(SchedulerSettings):
    kind: str = "ktransformers"
    label: str = "kTransformers"
    prefill_gpu_min_tokens: int = 1024  # prefill passes of at least this many tokens run experts on the GPU
    max_deferred_per_token: int = 0  # Expert Deferral: CPU experts per token whose output lands one layer late

    def __post_init__(self) -> None:
        if self.max_deferred_per_token < 0:
            raise ValueError(f"scheduler.max_deferred_per_token={self.max_deferred_per_token} must be >= 0")


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
        cpu = tuple(int(e) for e in missing)
        defers = state.phase is Phase.decode and bool(cpu) and state.layer < state.num_layers - 1
        return LayerPlan(cpu=cpu, gpu=gpu, defer=self.settings.max_deferred_per_token if defers else 0)
