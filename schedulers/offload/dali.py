"""DALI (Zhu et al., arXiv 2602.03495, 2026): workload-aware offloading, as its public text describes it.

- **Greedy assignment** of each step's experts to the CPU or the GPU (the paper models it as a 0-1 integer
  program and solves it greedily at runtime): the layer's active experts go in descending workload (tokens),
  each to the side that would finish it earlier, the GPU side paying the transfer of an expert that is not
  resident (the link is serial, behind `alpha`) and the CPU side its eq.-2 time. Resident experts may go to
  the CPU too (a static assignment is what DALI replaces), except where the device is the host itself.
- **Residual-based prefetching**: the next layer's gate applied to the current layer's residual stream
  predicts its high-workload experts; in moescope that forecast is the distance-1 predictor
  (`LayerState.predicted`, the LLaPor / gate / transition predictor the run configures). The experts predicted
  to carry the most tokens are prefetched, hottest first, while the link has room within this layer's
  expected time (its greedy assignment's span plus the next attention, minus alpha and the loads).
- **Workload-aware cache replacement**: what makes room goes lowest moving-average workload first
  (`eviction: token_share`, the share of the layer's tokens per pass: temporal correlation of activations),
  on-demand loads are kept (`retain_loads`), nothing is pinned after the hot-table start.

Departures (README "Where moescope departs from the papers"): the public text gives neither the integer
program's exact objective nor the residual predictor's architecture; the greedy is the list-scheduling one
above and the predictor is whichever the run configures.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.base import LayerPlan, LayerState, Phase, SchedulerSettings, register
from schedulers.policy import OffloadPolicy, layer_expert_times


@dataclass(frozen=True)
class DALISettings(SchedulerSettings):
    kind: str = "dali"
    label: str = "DALI"
    max_prefetch: int = 8  # at most this many next-layer prefetches per layer


def greedy_assignment(state: LayerState, may_move_resident: bool) -> tuple[list[int], list[int], list[int], float]:
    """(cpu experts, gpu experts, loads in link order, expected span): descending workload, each expert to the
    side that finishes it first (GPU: after its transfer when missing)."""
    cost = state.cost
    avail = state.available(state.layer).tolist()  # Python bools: the loop below indexes them per expert
    t_io = state.t_io_s
    landing = {t.expert: t.remaining_s for t in state.inflight if t.layer == state.layer}
    gpu_t = cost.t_shared(state.batch_tokens)
    link = state.alpha_s
    cpu_t = cost.cpu_dispatch_s
    cpu: list[int] = []
    gpu: list[int] = []
    loads: list[int] = []
    times = layer_expert_times(state)  # per expert, as `t_g(m)` / `t_c(m)` give them one at a time
    t_g, t_c = times.gpu, times.cpu
    hot = times.tokens  # descending tokens, ties by id (a stable sort of the ascending ids, as `by_tokens`'s)
    for e in sorted(state.active.tolist(), key=hot.__getitem__, reverse=True):  # reverse=True: a stable sort too
        if avail[e]:
            arrives = landing.get(e, 0.0)
            g_end = (arrives if arrives > gpu_t else gpu_t) + t_g[e]  # max() without its call, same value
            if not may_move_resident:
                gpu_t = g_end
                gpu.append(e)
                continue
            new_link = link
        else:
            new_link = link + t_io
            g_end = (new_link if new_link > gpu_t else gpu_t) + t_g[e]
        c_end = cpu_t + t_c[e]
        if g_end <= c_end:
            gpu_t, link = g_end, new_link
            gpu.append(e)
            if not avail[e]:
                loads.append(e)
        else:
            cpu_t = c_end
            cpu.append(e)
    span = max(gpu_t, cpu_t if cpu else 0.0)
    return cpu, gpu, loads, span


@register("dali", settings=DALISettings)
class DALI(OffloadPolicy):
    @property
    def resident_on_device(self) -> bool:
        """Resident experts may go to the CPU, unless the device is the host itself."""
        return self.cost.device_cpu_share >= 1

    def plan(self, state: LayerState) -> LayerPlan:
        self.observe_usage(state)
        cpu, gpu, loads, span = greedy_assignment(state, not self.resident_on_device)
        ready = [e for e in gpu if e not in set(loads)]
        gpu_t = tuple(ready) + tuple(loads)
        self.touch(state.layer, gpu_t)
        prefetch: list[tuple[int, int]] = []
        if state.phase is Phase.decode:
            room = int((span + state.t_attn_next_s - state.alpha_s - len(loads) * state.t_io_s) // state.t_io_s)
            if room > 0:
                prefetch = self.next_layer_prefetch(state, min(room, self.settings.max_prefetch))
        else:
            prefetch = self.next_layer_prefetch(state, self.settings.max_prefetch)
        return self.plan_with_slots(state, tuple(cpu), gpu_t, tuple(loads), prefetch)


__all__ = ["DALI", "DALISettings", "greedy_assignment"]
