"""Horizon: moescope's default offload scheduler. PreSched's cross-layer plan, its CPU/GPU split chosen
among several candidates by the layer time the cost model predicts, and two batches in flight (Klotski's
multi-batch pipeline, for any plan).

Per MoE layer, after its gate:

1. **PreSched's plan** (`schedulers.offload.presched`, Algorithm 1 with moescope's extensions): the split of
   eq. 4, the prefetches of eqs. 5-6 and Q4, the pinned-nothing token-share cache. Its bookkeeping (usage
   average, LRU stamps) is the cache's, whichever split runs.
2. **Candidate splits**, each a (CPU experts, GPU experts, on-demand loads hottest first):
   PreSched's own; eq. 1's per-layer optimum with the GPU's work on resident experts counted (`greedy_split`);
   HybriMoE's hybrid scheduling (cached experts first, the GPU taking from the front and the CPU from the back,
   `hybrid_scheduling`), only where resident experts may run on the CPU (`resident_on_device` off); and
   "every missing expert on the CPU" / "every missing expert loaded". Each is timed with one estimator,
   `layer_time`, that plays the layer the way the mechanism runs it: the shared experts and the resident
   experts in one device call, the experts landing from started transfers at their arrival, the loads one
   after another on the serial link behind `alpha` (each computed when it lands), the CPU experts one after
   another with one hand-over. The fastest wins; PreSched's split keeps ties. Its prefetches are kept (they
   queue behind whatever loads the chosen split issues), trimmed where the split's loads need their slots.
3. **Batches in flight** (`batches_in_flight`, default 2): `batch_size` x 2 sequences go through the layers
   together, one executor batch, each expert's weights crossing the link once for both (Klotski's reason for
   its pipeline, §5.1 of LayerScope: "two micro-batch parallelism"). Unlike Klotski the plan stays
   PreSched's hybrid one, and the two batches are one micro-batch (`micro_batches` 1): a second device call
   per expert costs more than overlapping the second batch's attention gains on every profile here
   (measured: `engine/bench/bench_horizon_study.py` rows `horizon_mb2`). The price is latency: a decode
   step serves twice the sequences, so each sequence's tokens come at most twice as far apart (the study
   reports decode latency beside throughput); `batches_in_flight: 1` gives the per-batch policy.

No forecast is read beyond what PreSched reads (the next layers' predictions through `LayerState.predicted`,
made by an online predictor from what has run so far): the plan of layer l depends on the routing of layers
<= l, the cache and the link, never on later routing (`tests/test_horizon.py` proves it by changing the
routing after l).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from schedulers.base import LayerPlan, LayerState, Phase, register
from schedulers.offload.hybrimoe import hybrid_scheduling
from schedulers.offload.layerwise import greedy_split
from schedulers.offload.presched import PreSched, PreSchedSettings
from schedulers.policy import by_tokens, split_by_availability


@dataclass(frozen=True)
class HorizonSettings(PreSchedSettings):
    """Horizon's knobs beside PreSched's (conf/scheduler/horizon.yaml)."""

    kind: str = "horizon"
    label: str = "Horizon"
    batches_in_flight: int = 2  # batches of `batch_size` sequences run through the layers together
    micro_batches: int = 1  # device calls per expert and layer (each in-flight batch its own call: 2)
    candidates: tuple[str, ...] = ("presched", "greedy", "hss", "all_cpu", "all_gpu")  # splits compared per layer

    def __post_init__(self) -> None:
        unknown = set(self.candidates) - set(SPLITS)
        if unknown or not self.candidates:
            raise ValueError(f"scheduler.candidates: {sorted(unknown) or '[]'} not among {sorted(SPLITS)}")
        if self.batches_in_flight < 1 or self.micro_batches < 1:
            raise ValueError(f"scheduler.batches_in_flight ({self.batches_in_flight}) and scheduler.micro_batches "
                             f"({self.micro_batches}) must be >= 1")

    @property
    def in_flight(self) -> int:
        return self.batches_in_flight


SPLITS = ("presched", "greedy", "hss", "all_cpu", "all_gpu")


@dataclass(frozen=True)
class Split:
    """One candidate: experts of this layer on the CPU, on the GPU, and the GPU ones loaded now (link order)."""

    name: str
    cpu: tuple[int, ...]
    gpu: tuple[int, ...]
    loads: tuple[int, ...]


def layer_time(state: LayerState, split: Split, held: Sequence[int] = ()) -> float:
    """Seconds from the gate until the layer's CPU and GPU sides are both done, as the mechanism runs `split`:
    shared + resident experts in one call, landing ones at arrival, loads serial on the link behind `alpha`
    (behind the held prefetches too), each computed on landing; the CPU experts one after another."""
    cost = state.cost
    landing, shared, _, tok = _layer_parts(state)
    gpu = shared
    if split.gpu:
        ready = len(split.gpu) - len(split.loads)
        if not landing and not held and split.gpu[ready:] == split.loads:  # the splits list the loads last
            now = split.gpu[:ready]
        else:
            later = {*split.loads, *landing, *held}  # a set, not np.isin: a layer's few experts, five splits per plan
            now = tuple(e for e in split.gpu if e not in later)
        gpu = shared + group_time(state, now)
    if landing:
        for e in sorted((e for e in split.gpu if e in landing), key=landing.__getitem__):
            gpu = max(gpu, landing[e]) + float(cost.t_g(tok[e]))
    # the held prefetches, then the loads, land one t_io apart behind alpha; each is computed on landing:
    # g_k = max(g_{k-1}, link_k) + t_k unrolls to max(g_0 + sum t, max_k(link_k + sum_{j >= k} t_j))
    queue = [e for e in split.gpu if e in held] + list(split.loads) if held else split.loads
    if queue:
        alpha, t_io = state.alpha_s, state.t_io_s
        tail, last = 0.0, -math.inf
        for k in range(len(queue) - 1, -1, -1):  # tail sums from the last load back, as a reversed cumsum adds
            tail += cost.t_g(tok[queue[k]])
            last = max(last, alpha + t_io * (k + 1) + tail)
        gpu = max(gpu + tail, last)
    cpu = cost.t_c_sum([tok[e] for e in split.cpu])
    s = cost.device_cpu_share  # where the device is the host, each side also waits for its share of the other
    return max(cpu + s * gpu, gpu + s * cpu) if s > 0 else max(cpu, gpu)


def _layer_parts(state: LayerState) -> tuple[dict[int, float], float, dict[tuple[int, ...], float], list[int]]:
    """(this layer's landing experts -> seconds to arrival, the shared experts' time, the memo of `group_time`, the
    tokens per expert as a list), built once per layer state: the candidate splits of one plan share them."""
    parts = state.__dict__.get("_horizon_parts")
    if parts is None:
        landing = {t.expert: t.remaining_s for t in state.inflight if t.layer == state.layer}
        parts = state.__dict__["_horizon_parts"] = (landing, state.cost.t_shared(state.batch_tokens), {},
                                                    state.tokens.tolist())
    return parts


def group_time(state: LayerState, experts: tuple[int, ...]) -> float:
    """GPU seconds of `experts` (in this order) run in one device call: `sum(cost.t_g_group(tokens))`, remembered per
    layer state (most candidate splits run the same resident experts)."""
    groups = _layer_parts(state)[2]
    if experts not in groups:
        groups[experts] = float(np.sum(state.cost.t_g_group(state.tokens[list(experts)]))) if experts else 0.0
    return groups[experts]


def candidate_splits(state: LayerState, names: Sequence[str], may_move_resident: bool) -> list[Split]:
    """The candidate splits of `names` other than PreSched's (which comes from its plan)."""
    tok, cost = state.tokens, state.cost
    ready, missing = split_by_availability(state)
    cur = by_tokens(missing, tok)  # ascending
    ready_t = tuple(ready.tolist())
    out: list[Split] = []
    for name in names:
        if name == "greedy":
            ready_s = cost.t_shared(state.batch_tokens) + group_time(state, ready_t) if ready.size \
                else cost.t_shared(state.batch_tokens)
            t_g = float(cost.t_g(max(int(tok.max(initial=1)), 1)))
            i = greedy_split(tok[cur].astype(np.float64), ready_s, state.alpha_s, state.t_io_s, t_g, cost)
            loads = tuple(cur[i:][::-1].tolist())
            out.append(Split(name, tuple(cur[:i].tolist()), ready_t + loads, loads))
        elif name == "hss" and may_move_resident:
            cpu, gpu = hybrid_scheduling(ready, missing, tok, state.t_io_s, cost, state.alpha_s)
            miss = set(int(e) for e in missing)
            loads = tuple(e for e in gpu if e in miss)
            out.append(Split(name, tuple(int(e) for e in cpu), tuple(e for e in gpu if e not in miss) + loads, loads))
        elif name == "all_cpu":
            out.append(Split(name, tuple(cur.tolist()), ready_t, ()))
        elif name == "all_gpu":
            loads = tuple(cur[::-1].tolist())
            out.append(Split(name, (), ready_t + loads, loads))
    return out


@register("horizon", settings=HorizonSettings)
class Horizon(PreSched):
    """See the module docstring."""

    @property
    def micro_batches(self) -> int:
        return max(1, self.settings.micro_batches)

    def plan(self, state: LayerState) -> LayerPlan:
        base = super().plan(state)  # PreSched's plan: its bookkeeping is the cache's whichever split runs
        if state.phase is Phase.prefill and "presched" in self.settings.candidates:
            return base  # PreSched's prefill split is already eq. 1's optimum with the GPU's work counted
        names = [n for n in self.settings.candidates if n != "presched"]
        splits = candidate_splits(state, names, not self.resident_on_device)
        if "presched" in self.settings.candidates:
            splits.insert(0, Split("presched", base.cpu, base.gpu, base.ondemand))
        best = min(splits, key=lambda s: layer_time(state, s))  # first minimum: PreSched's split keeps ties
        if best.name == "presched":
            return base
        return self.with_split(state, base, best)

    def with_split(self, state: LayerState, base: LayerPlan, split: Split) -> LayerPlan:
        """PreSched's plan with `split` instead of its own: evictions of experts the split computes on the GPU
        are dropped, loads it did not retain pass through staging, prefetches are trimmed to the slots left."""
        layer = state.layer
        gpu = set(split.gpu)
        evict = tuple(v for v in base.evict if not (v[0] == layer and v[1] in gpu))
        kept = dict(zip(base.ondemand, base.retain))
        retain = tuple(bool(kept.get(e, False)) for e in split.loads)
        room = max(state.free_slots, 0) + len(evict) - len(base.hold)
        retain = tuple(r and i < room for i, r in enumerate(retain))
        prefetch = base.prefetch[:max(room - sum(retain), 0)]
        self.touch(layer, split.gpu)
        return replace(base, cpu=split.cpu, gpu=split.gpu, ondemand=split.loads, retain=retain, prefetch=prefetch,
                       evict=evict)


def plan_time(state: LayerState, plan: LayerPlan) -> float:
    """`layer_time` of a plan (tests and the study compare policies' splits with it)."""
    return layer_time(state, Split("plan", plan.cpu, plan.gpu, plan.ondemand), sorted(plan.held_here(state.layer)))


__all__ = ["Horizon", "HorizonSettings", "Split", "layer_time", "candidate_splits", "plan_time"]
