"""Discrete-event simulation of offloaded MoE inference: one GPU stream, one serial host->device
link with a software queue, a CPU expert pool; a scheduler's plans applied layer by layer.

Per MoE layer: attention on the GPU (split per micro-batch where the scheduler pipelines them) ->
gate -> the link settles (landed transfers become resident, started ones keep going, unstarted ones
are dropped) -> `scheduler.plan(state)` -> evictions; the prefetches the plan holds, on-demand loads,
then prefetches are queued on the link -> the GPU runs its experts as their weights become available
(resident ones first, loads in arrival order, a staging buffer reused once its previous expert is
done), the CPU runs its experts one after another -> the layer ends when both are done. Dense
decoder layers and the LM head run on the GPU. Without AsyncIO every copy is synchronous: it blocks the GPU stream, takes
`t_io_sync`, and prefetches finish inside the layer that issued them. What a plan does to the cache,
the link queue and the metrics is `engine.offload.accounting`, shared with the real executor; this
module only models how long things take.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from engine.offload.accounting import Event, LayerAccounting, QueuedTransfer, ResidencyTable
from engine.offload.deferral import deferred_pairs, pair_counts
from engine.offload.forecasts import ForecastBook, LazyForecasts
from engine.offload.metrics import RunMetrics
from engine.offload.speculation import speculated_routing, working_plan
from engine.sim.workload import ForwardPass, microbatch_loads
from core.trace import RoutingTrace
from models.config import ModelConfig
from schedulers.base import LayerPlan, LayerState, OffloadScheduler, Phase, PlanningPrice, Transfer
from schedulers.cost import CostModel


class InvariantError(AssertionError):
    """The mechanism broke one of its invariants (a simulator bug or an invalid plan)."""


@dataclass
class Job:
    """One transfer on the link (committed once it starts before the next plan point)."""

    layer: int
    expert: int
    start: float
    end: float
    retain: bool
    prefetch: bool
    pass_index: int = -1
    counted: bool = False


@dataclass
class LayerClock:
    """The lanes of one simulated MoE layer while its plan runs."""

    gate: float  # the plan point (the first micro-batch's gate), or the end of the plan where its time is charged
    gpu_free: float  # the GPU stream is free from here
    gpu_busy: float  # GPU time of the layer's experts (shared experts included)
    link_free: float  # the link can start the next transfer from here
    t_io: float  # one transfer as the link runs it now
    jobs: list[Job] = field(default_factory=list)  # the transfers the plan issued, in link order


@dataclass
class PassContext:
    fp: ForwardPass
    begin: float
    attn_parts: list[float]
    t_attn: float
    t_dense: float  # one dense decoder layer (attention + MLP)
    t_shared: float
    mb: Optional[np.ndarray]


PLANNING_MODES = ("off", "measured", "measured_cpu", "fixed")


@dataclass(frozen=True)
class PlanningCharge:
    """The policy's own planning time charged on the host's critical path per MoE layer (`simulate.planning`).

    The profiles' fixed host time per layer (`layer_overhead_us`) is 0 on every GPU profile, so by default no
    policy pays for its `plan` call, whatever it costs. With a charge, a layer's plan runs on the host from its gate
    (or once the host's previous plan is done) for the charged time, and the plan's work starts when it ends: its
    transfers (the link holds its queue while the plan is made, as the executor does), its CPU experts, its GPU
    experts other than the resident ones that a policy keeping resident experts on the device (`resident_on_device`)
    starts right after the gate, as the executor does. A layer whose active experts are all resident under such a
    policy is planned behind the device (the executor's `plan_behind_device`): only its transfers and the next
    layer's plan wait. Modes: `off` (default; results stay comparable with every study so far), `measured` (each
    plan call's own `perf_counter` time: what a Python policy costs on this host, load included), `measured_cpu`
    (its thread CPU time: the same without the time the host's other jobs take from it), `fixed` (`fixed_us` by the
    policy's `scheduler.kind`, per plan call: reproducible studies; `search_us.<kind>` more for a call that ran the
    policy's optional search, `OffloadPolicy.searched`). The policy is told the price (`price`,
    `SchedulerSetup.planning`): a policy with optional plan work (Horizon's search) weighs it against it."""

    mode: str = "off"
    fixed_us: dict[str, float] = field(default_factory=dict)  # mode fixed: µs per plan call by scheduler kind
    search_us: dict[str, float] = field(default_factory=dict)  # mode fixed: µs more for a call that ran its search

    def __post_init__(self) -> None:
        if self.mode not in PLANNING_MODES:
            raise ValueError(f"planning.mode: {self.mode!r} is not one of {'|'.join(PLANNING_MODES)}")
        for key, table in (("fixed_us", self.fixed_us), ("search_us", self.search_us)):
            bad = {k: v for k, v in table.items() if not v >= 0}
            if bad:
                raise ValueError(f"planning.{key}: {bad} must be >= 0 µs")

    def fixed_s(self, kind: str) -> float:
        """Seconds charged per plan call of a policy of `kind` in mode `fixed`."""
        if kind not in self.fixed_us:
            raise ValueError(f"planning.fixed_us has no entry for scheduler kind {kind!r} (planning.mode=fixed); "
                             f"given: {sorted(self.fixed_us)}")
        return float(self.fixed_us[kind]) * 1e-6

    def search_s(self, kind: str) -> float:
        """Seconds charged more for a plan call of a policy of `kind` that ran its optional search (mode `fixed`)."""
        return float(self.search_us.get(kind, 0.0)) * 1e-6

    def price(self, kind: str) -> PlanningPrice:
        """What this charge tells a policy of `kind` its plans cost: nothing (off), its calls' time on the clock the
        charge reads (measured, measured_cpu), or its fixed price of a search (fixed: `search_us.<kind>`)."""
        if self.mode == "off":
            return PlanningPrice()
        if self.mode == "fixed":
            return PlanningPrice(search_s=self.search_s(kind))
        return PlanningPrice(clock=self.clock)

    @property
    def clock(self) -> Callable[[], float]:
        """The clock a measured charge reads over each plan call."""
        return time.thread_time if self.mode == "measured_cpu" else time.perf_counter


@dataclass
class SimOptions:
    planning: PlanningCharge = field(default_factory=PlanningCharge)  # the policy's planning time on the host
    async_io: bool = True
    check_invariants: bool = False
    record: bool = False  # keep every event (timelines of small runs, invariant tests)
    record_passes: Optional[set[int]] = None  # record only these passes (None: all when record is on)


@dataclass
class PipelineSim:
    """One simulated run: a model on a machine under a scheduler, replaying forward passes."""

    cfg: ModelConfig
    cost: CostModel
    scheduler: OffloadScheduler
    cache_slots: int
    staging_slots: int
    trace: RoutingTrace
    forecasts: Optional[ForecastBook] = None
    options: SimOptions = field(default_factory=SimOptions)

    def __post_init__(self) -> None:
        self.L = len(self.cfg.moe_layers)
        self.E = self.cfg.num_experts
        if self.trace.num_layers != self.L or self.trace.meta.num_experts != self.E:
            raise ValueError(f"trace has {self.trace.num_layers} MoE layers x {self.trace.meta.num_experts} experts, "
                             f"model {self.L} x {self.E}")
        if self.staging_slots < 1:
            raise ValueError("staging_slots must be >= 1 (on-demand loads need a buffer)")
        self.residency = ResidencyTable(self.scheduler.initial_residency())
        if self.resident.shape != (self.L, self.E):
            raise ValueError(f"initial residency has shape {self.resident.shape}, expected ({self.L}, {self.E})")
        if self.n_resident > self.cache_slots:
            raise ValueError(f"{self.scheduler.name}: initial residency of {self.n_resident} experts exceeds "
                             f"the cache of {self.cache_slots}")
        self.jobs: list[Job] = []  # scheduled on the link, in start order
        self.link_end = 0.0  # end of the last transfer that ran
        self.now = 0.0
        self.cpu_free = 0.0  # the CPU lane is free from here (later than a layer's end only under Expert Deferral)
        self.deferred_due = 0.0  # deferred outputs of the last MoE layer are done here: the next one ends no earlier
        # speculative execution: (pass, MoE layer) -> int64 [E] tokens per expert computed where they differ from routed
        self.executed_loads: dict[tuple[int, int], np.ndarray] = {}
        self.missed_pairs = 0  # (token, slot) pairs computed by another expert than the routed one (or dropped)
        self.accounting = LayerAccounting(self.L, self.cost.expert_bytes)
        # decoder layers between MoE layers: dense[i] dense layers run before MoE layer i, dense[L] after the last
        dense = [0] * (self.L + 1)
        moe = set(self.cfg.moe_layers)
        i = 0
        for layer in range(self.cfg.num_hidden_layers):
            if layer in moe:
                i += 1
            else:
                dense[i] += 1
        self._dense_before = dense
        self.micro_batches = max(1, int(getattr(self.scheduler, "micro_batches", 1)))
        self.host_free = 0.0  # the host's last charged plan ends here (`SimOptions.planning`)
        self.planning_s: list[tuple[bool, float]] = []  # (prefill, seconds charged) per plan call, when charged

    @property
    def resident(self) -> np.ndarray:
        """bool [L, E]: experts landed in the cache."""
        return self.residency.mask

    @property
    def n_resident(self) -> int:
        return self.residency.count

    @property
    def metrics(self) -> RunMetrics:
        return self.accounting.metrics

    @property
    def events(self) -> list[Event]:
        return self.accounting.events

    def _records(self, pass_index: int) -> bool:
        """Whether the events of pass `pass_index` are kept."""
        opts = self.options
        return opts.record and (opts.record_passes is None or pass_index in opts.record_passes)

    # ---- link --------------------------------------------------------------------------------
    def _settle(self, now: float) -> list[Job]:
        """The plan point at `now`: land finished transfers, keep started ones, drop those not started
        (returned)."""
        keep, dropped = [], []
        for job in self.jobs:
            if job.start < now:
                if not job.counted:
                    self._commit(job)
                if job.end <= now:
                    if job.retain:
                        self._land(job)
                else:
                    keep.append(job)
            else:
                dropped.append(job)
        self.jobs = keep
        self.accounting.settle_prefetches(dropped)
        return dropped

    def _commit(self, job: Job) -> None:
        """A transfer has started: it will run to its end (Premise 3)."""
        if job.counted:
            return
        job.counted = True
        self.link_end = max(self.link_end, job.end)
        self.accounting.transfer(job, job.start, job.end, job.pass_index, self._records(job.pass_index))

    def _land(self, job: Job) -> None:
        if job.retain:
            self.residency.land(job.layer, job.expert)

    def _reserved(self) -> int:
        return sum(1 for job in self.jobs if job.retain)

    # ---- one MoE layer -------------------------------------------------------------------------
    def _state(self, fp: ForwardPass, layer: int, dropped: list[Job], tokens: np.ndarray, t_attn_next: float,
               t_io: float, mb: Optional[np.ndarray]) -> LayerState:
        now = self.now
        inflight = tuple(Transfer(job.layer, job.expert, job.end - now, job.retain) for job in self.jobs)
        queued = tuple(Transfer(job.layer, job.expert, 0.0, job.retain) for job in dropped)
        alpha = max((job.end - now for job in self.jobs), default=0.0)
        predicted = LazyForecasts(self.forecasts, layer, fp.index, fp.rows, self.L) \
            if self.forecasts is not None else {}
        hit = self.forecasts.hit_rates() if self.forecasts is not None else {}
        reserved = self._reserved()
        return LayerState(
            layer=layer, num_layers=self.L, phase=Phase.prefill if fp.prefill else Phase.decode,
            tokens=tokens, scores=fp.scores[layer], predicted=predicted, resident=self.resident,
            inflight=inflight, queued=queued, alpha_s=alpha, cache_slots=self.cache_slots,
            free_slots=self.cache_slots - self.n_resident - reserved, batch_tokens=fp.tokens,
            context_len=fp.context_len, hit_rate=hit, cost=self.cost, t_io_s=t_io, t_attn_next_s=t_attn_next,
            tokens_by_microbatch=None if mb is None else mb[:, layer])

    def _run_layer(self, fp: ForwardPass, layer: int, t_attn_parts: list[float], t_shared: float,
                   t_attn_next: float, mb: Optional[np.ndarray]) -> None:
        """MoE layer `layer` of pass `fp` from `self.now`: attention, the plan point, the plan on the lanes."""
        start = self.now
        gates = self._attention(layer, start, t_attn_parts)
        gate, gate_last = float(gates[0]), float(gates[-1])
        state = self._plan_point(fp, layer, gate, t_attn_next, mb)
        plan, planned = self._plan(state, gate)
        queue = self.accounting.issue(layer, plan, self.residency)
        clock = LayerClock(gate=planned, gpu_free=gate_last + t_shared, gpu_busy=t_shared,
                           link_free=self._link_free(planned), t_io=state.t_io_s)
        if t_shared > 0:
            self.accounting.record("gpu", gate_last, clock.gpu_free, layer, kind="shared")
        mb_layer = None if mb is None else mb[:, layer]
        held, queue = queue[:len(plan.hold)], queue[len(plan.hold):]
        self._prefetch(clock, held)  # they keep the head of the link: this layer's GPU experts among them land first
        tokens, plan = self._speculate(fp, layer, plan, state.tokens)
        # the resident experts: where the policy keeps them on the device, the executor starts them before the plan
        early = -math.inf if planned == gate or self.scheduler.resident_on_device else planned
        self._compute_available(clock, layer, plan, tokens, mb_layer, early, planned)
        self._load(clock, layer, [item for item in queue if not item.prefetch], tokens,
                   self._issue_times(layer, plan, gates, mb), mb_layer)
        self._prefetch(clock, [item for item in queue if item.prefetch])
        self._queue(clock.jobs)
        due = self.deferred_due  # the last MoE layer's deferred outputs are added with this layer's
        cpu_start = max(gate_last, planned) if plan.cpu else gate_last  # CPU experts are handed over once planned
        cpu_free = self._compute_cpu(layer, plan, self._cpu_tokens(fp, layer, plan, tokens), cpu_start)
        end = max(clock.gpu_free, cpu_free, due)
        if planned > end and not self._behind(state, plan):  # the next layer's attention is dispatched after the plan
            end = planned
        if self.options.check_invariants:
            self._check_capacity(layer)
        self.accounting.close_layer(fp.prefill, layer, plan, end - start, clock.gpu_busy + sum(t_attn_parts),
                                    cpu_free - cpu_start)
        self.now = end

    def _plan(self, state: LayerState, gate: float) -> tuple[LayerPlan, float]:
        """(the scheduler's plan, when the plan's work may start): the gate, or with a charged planning time
        (`SimOptions.planning`) the end of the plan on the host, which starts once the host's previous plan is done."""
        charge, validate = self.options.planning, self.options.check_invariants
        if charge.mode == "off":
            return self.accounting.plan(self.scheduler, state, validate=validate), gate
        clock = charge.clock
        begin = clock()
        plan = self.scheduler.plan(state)
        seconds = clock() - begin
        plan = self.accounting.check(self.scheduler, state, plan, validate)
        if charge.mode == "fixed":
            kind = self.scheduler.settings.kind
            seconds = charge.fixed_s(kind) + (charge.search_s(kind) if getattr(self.scheduler, "searched", False) else 0.0)
        self.planning_s.append((state.phase is Phase.prefill, seconds))
        self.host_free = max(gate, self.host_free) + seconds
        return plan, self.host_free

    def _behind(self, state: LayerState, plan: LayerPlan) -> bool:
        """Whether the layer is planned behind the device (the executor's `plan_behind_device`): a policy that keeps
        resident experts on the device, every active expert of the layer resident (started before the plan), and a
        plan with nothing else for the layer. The next layer's attention then need not wait for the plan."""
        return bool(self.scheduler.resident_on_device and not plan.cpu and not plan.ondemand and not plan.defer
                    and plan.speculate is None and self.resident[state.layer, state.active].all())

    def _attention(self, layer: int, start: float, parts: list[float]) -> np.ndarray:
        """The attention calls (one per micro-batch) from `start`; returns the gates, one per micro-batch."""
        if self.accounting.recording:
            begin = start
            for part in parts:
                self.accounting.record("gpu", begin, begin + part, layer, kind="attn")
                begin += part
        # the executor's fixed host time per MoE layer (router output to the host, planning) delays the plan
        return np.cumsum(parts) + start + self.cost.layer_overhead_s

    def _plan_point(self, fp: ForwardPass, layer: int, gate: float, t_attn_next: float,
                    mb: Optional[np.ndarray]) -> LayerState:
        """The gate of MoE layer `layer`: the link settles, the forecasts for the layer are scored, and the
        state the scheduler sees is built and accounted (residency, prefetch outcome)."""
        self.now = gate
        dropped = self._settle(gate)
        if self.forecasts is not None:
            self.forecasts.settle(layer, fp.rows)
        t_io = self.cost.t_io if self.options.async_io else self.cost.t_io_sync
        state = self._state(fp, layer, dropped, fp.loads[layer], t_attn_next, t_io, mb)
        self.accounting.open_layer(state)
        return state

    def _link_free(self, gate: float) -> float:
        """When the link can start the plan's first transfer (after the started ones)."""
        return max(gate, max((job.end for job in self.jobs), default=self.link_end))

    def _issue_times(self, layer: int, plan: LayerPlan, gates: np.ndarray,
                     mb: Optional[np.ndarray]) -> dict[int, float]:
        """Micro-batched layers: each load is issued at the gate of the first micro-batch routed to it."""
        if mb is None or len(gates) < 2 or not plan.ondemand:
            return {}
        needs = mb[:, layer, list(plan.ondemand)] > 0  # [micro-batches, loads]
        first = np.where(needs.any(axis=0), needs.argmax(axis=0), len(gates) - 1)
        return dict(zip(plan.ondemand, gates[first].tolist()))

    def _expert_gpu_s(self, experts: list[int], tokens: np.ndarray, mb_layer: Optional[np.ndarray],
                      group: bool = False) -> np.ndarray:
        """float [n]: GPU time of `experts`, each in a call of its own (`group`: all in one device call, its
        dispatch paid once). A micro-batched layer calls them once per micro-batch routing tokens to them: the
        batches in flight run the layer one after another, each its own expert calls over weights loaded once."""
        f = self.cost.t_g_group if group else self.cost.t_g
        if mb_layer is None:
            return np.atleast_1d(f(tokens[experts]))
        return np.sum([np.atleast_1d(f(row)) for row in mb_layer[:, experts]], axis=0)

    def _compute_available(self, clock: "LayerClock", layer: int, plan: LayerPlan, tokens: np.ndarray,
                           mb_layer: Optional[np.ndarray] = None, early: float = -math.inf,
                           planned: float = -math.inf) -> None:
        """The GPU experts whose weights are there: the resident ones in one device call (from `early` at the
        soonest), then those landing from started transfers and held prefetches, in arrival order, from `planned` at
        the soonest (the end of a charged plan: they are called once it is made)."""
        landing = {job.expert: job.end for job in (*self.jobs, *clock.jobs) if job.layer == layer}
        resident = self._resident_experts(plan, landing)
        if early > clock.gpu_free:
            clock.gpu_free = early
        if resident:
            counts = tokens[resident]
            spans = self._expert_gpu_s(resident, tokens, mb_layer, group=True)  # the resident experts: one call
            if self.accounting.recording:
                begin = clock.gpu_free
                for expert, span, count in zip(resident, np.atleast_1d(spans), counts):
                    self.accounting.record("gpu", begin, begin + span, layer, expert, int(count), "expert")
                    begin += span
            clock.gpu_free += float(np.sum(spans))
            clock.gpu_busy += float(np.sum(spans))
        for expert in sorted((expert for expert in plan.gpu if expert in landing), key=landing.__getitem__):
            begin = max(clock.gpu_free, landing[expert], planned)  # called once planned (a load: its link starts then)
            span = self.cost.t_g(int(tokens[expert])) if mb_layer is None \
                else float(self._expert_gpu_s([expert], tokens, mb_layer)[0])
            clock.gpu_free = begin + span
            clock.gpu_busy += span
            self.accounting.record("gpu", begin, clock.gpu_free, layer, expert, int(tokens[expert]), "expert")

    @staticmethod
    def _resident_experts(plan: LayerPlan, landing: dict[int, float]) -> list[int]:
        """The plan's GPU experts neither loaded now nor landing (plans list them first)."""
        loads = set(plan.ondemand)
        ready = len(plan.gpu) - len(plan.ondemand)
        if landing or set(plan.gpu[ready:]) != loads:
            return [expert for expert in plan.gpu if expert not in loads and expert not in landing]
        return list(plan.gpu[:ready])

    def _load(self, clock: "LayerClock", layer: int, loads: list[QueuedTransfer], tokens: np.ndarray,
              issue_times: dict[int, float], mb_layer: Optional[np.ndarray] = None) -> None:
        """The plan's on-demand loads on the link, each computed on the GPU once it has landed."""
        if not loads:
            return
        experts = [item.expert for item in loads]
        counts = tokens[experts]
        spans = self._expert_gpu_s(experts, tokens, mb_layer).tolist()
        if len(loads) > 8 and self.options.async_io and not issue_times and not self.accounting.recording \
                and self._load_back_to_back(clock, loads, spans):
            return
        self._load_one_by_one(clock, layer, loads, counts.tolist(), spans, issue_times)

    def _load_back_to_back(self, clock: "LayerClock", loads: list[QueuedTransfer], spans: list[float]) -> bool:
        """Loads back to back in one go (the GPU end of load k is a running max); False, with nothing done,
        when a staged load would have to wait for a staging buffer (`_load_one_by_one` models that)."""
        t_io = clock.t_io
        first = clock.link_free if clock.link_free > clock.gate else clock.gate
        ends = first + t_io * np.arange(1, len(loads) + 1)
        span = np.asarray(spans)
        done = np.cumsum(span)
        finish = done + np.maximum.accumulate(np.maximum(ends - (done - span), clock.gpu_free))
        staged = np.flatnonzero([not item.retain for item in loads])
        buffers = self.staging_slots
        # a staged load may start only once the load `buffers` staged loads earlier finished on the GPU
        if staged.size > buffers and np.any(ends[staged[buffers:]] - t_io < finish[staged[:-buffers]] - 1e-15):
            return False
        pass_index = self.accounting.pass_index
        for item, end in zip(loads, ends.tolist()):
            clock.jobs.append(Job(item.layer, item.expert, end - t_io, end, item.retain, item.prefetch, pass_index))
        clock.link_free = float(ends[-1])
        clock.gpu_free = float(finish[-1])
        clock.gpu_busy += float(done[-1])
        return True

    def _load_one_by_one(self, clock: "LayerClock", layer: int, loads: list[QueuedTransfer], counts: list[int],
                         spans: list[float], issue_times: dict[int, float]) -> None:
        """Loads one after another: a staged load waits for its staging buffer, a micro-batched one for its
        gate, a synchronous one for the GPU stream."""
        buffers = self.staging_slots
        buffer_free = [0.0] * buffers
        staged = 0
        sync = not self.options.async_io
        pass_index = self.accounting.pass_index
        for item, count, span in zip(loads, counts, spans):
            begin = clock.link_free if clock.link_free > clock.gate else clock.gate
            if issue_times:
                begin = max(begin, issue_times.get(item.expert, clock.gate))
            buffer = staged % buffers
            if not item.retain and buffer_free[buffer] > begin:
                begin = buffer_free[buffer]
            if sync and clock.gpu_free > begin:
                begin = clock.gpu_free
            end = begin + clock.t_io
            clock.link_free = end
            clock.jobs.append(Job(item.layer, item.expert, begin, end, item.retain, item.prefetch, pass_index))
            compute = clock.gpu_free if clock.gpu_free > end else end
            clock.gpu_free = compute + span
            clock.gpu_busy += span
            self.accounting.record("gpu", compute, clock.gpu_free, layer, item.expert, count, "expert")
            if not item.retain:
                buffer_free[buffer] = clock.gpu_free
                staged += 1

    def _prefetch(self, clock: "LayerClock", prefetches: list[QueuedTransfer]) -> None:
        """The prefetches behind the loads; a synchronous copy holds the GPU stream and the host thread."""
        sync = not self.options.async_io
        pass_index = self.accounting.pass_index
        for item in prefetches:
            begin = max(clock.link_free, clock.gate, clock.gpu_free) if sync else max(clock.link_free, clock.gate)
            end = begin + clock.t_io
            clock.link_free = end
            clock.jobs.append(Job(item.layer, item.expert, begin, end, item.retain, item.prefetch, pass_index))
            if sync:
                clock.gpu_free = end

    def _queue(self, jobs: list[Job]) -> None:
        """The plan's transfers go on the link; synchronous copies complete inside this layer."""
        self.jobs.extend(jobs)
        if not self.options.async_io:
            for job in jobs:
                self._commit(job)

    def _cpu_tokens(self, fp: ForwardPass, layer: int, plan: LayerPlan,
                    tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens per expert the layer waits for, tokens per expert deferred to the next MoE layer): Expert
        Deferral's split of the CPU experts' (token, slot) pairs (`engine.offload.deferral`); else (tokens, 0)."""
        if not plan.defer:
            return tokens, np.zeros_like(tokens)
        experts = self.trace.experts[layer, fp.rows].astype(np.int64)
        mask = deferred_pairs(experts, self.trace.weights[layer, fp.rows], plan.cpu, plan.defer)
        later = pair_counts(np.where(mask, experts, -1), self.E)
        return tokens - later, later

    def _speculate(self, fp: ForwardPass, layer: int, plan: LayerPlan,
                   tokens: np.ndarray) -> tuple[np.ndarray, LayerPlan]:
        """(int64 [E] tokens per expert the layer computes, the plan it runs): the routed ones and the plan, or under
        speculative execution those of `engine.offload.speculation.speculated_routing` and the plan without the
        speculated experts no pair uses (recorded in `executed_loads` for the invariant checks)."""
        if plan.speculate is None:
            return tokens, plan
        if self.micro_batches > 1:
            raise ValueError(f"{self.scheduler.name}: speculative execution with micro-batches is not modelled")
        routed = self.trace.experts[layer, fp.rows]
        executed = speculated_routing(routed, plan.speculate)
        self.missed_pairs += int(np.sum((executed != routed) & (routed >= 0)))
        counts = pair_counts(executed, self.E)
        self.executed_loads[(fp.index, layer)] = counts
        return counts, working_plan(plan, executed, self.E)

    def _cpu_lane(self, layer: int, experts: tuple[int, ...], counts: np.ndarray, start: float, kind: str) -> float:
        """`experts` with `counts` tokens one after another on the CPU lane from `start`, one hand-over; returns the
        end (experts without tokens take no time)."""
        spans = np.atleast_1d(self.cost.t_c(counts))
        if not np.any(spans):
            return start
        if self.accounting.recording:
            begin = start
            for expert, span, count in zip(experts, spans, counts):
                if count:  # an expert whose pairs all run on time (or all late) has no event on the other side
                    self.accounting.record("cpu", begin, begin + span, layer, expert, int(count), kind)
                begin += span
        return start + (float(spans.sum()) + self.cost.cpu_dispatch_s)

    def _compute_cpu(self, layer: int, plan: LayerPlan, split: tuple[np.ndarray, np.ndarray], start: float) -> float:
        """The CPU experts one after another on the CPU lane from `start` (or once the lane is free: deferred work of
        the last layer may hold it); returns when the layer's own CPU side is done. Deferred pairs (`split[1]`) run
        after it and set when the next MoE layer may end at the earliest (`deferred_due`)."""
        now, later = split
        self.deferred_due = 0.0
        if not plan.cpu:
            return start
        cpu = list(plan.cpu)
        begin = max(start, self.cpu_free)
        done = self._cpu_lane(layer, plan.cpu, now[cpu], begin, "expert")
        self.cpu_free = done
        if plan.defer:
            self.cpu_free = self.deferred_due = self._cpu_lane(layer, plan.cpu, later[cpu], done, "deferred")
        return done

    def _check_capacity(self, layer: int) -> None:
        used = self.n_resident + self._reserved()
        if used > self.cache_slots or self.n_resident != int(self.resident.sum()):
            raise InvariantError(f"layer {layer}: {used} cache slots used of {self.cache_slots}")

    # ---- passes --------------------------------------------------------------------------------
    def _gpu_block(self, duration: float, layer: int, kind: str) -> None:
        if duration > 0:
            self.accounting.record("gpu", self.now, self.now + duration, layer, kind=kind)
        self.now += duration

    def start_pass(self, fp: ForwardPass) -> "PassContext":
        """Per-pass constants (attention per micro-batch, dense layers, shared experts)."""
        self.accounting.pass_index = fp.index
        self.accounting.recording = self._records(fp.index)
        cost = self.cost
        if fp.prefill:
            attn_one = lambda seqs: cost.t_attn(seqs, 0, prefill=True, prompt_len=fp.context_len)  # noqa: E731
        else:
            attn_one = lambda seqs: cost.t_attn(seqs, fp.context_len)  # noqa: E731
        M = self.micro_batches if fp.num_seqs >= self.micro_batches else 1
        mb = microbatch_loads(self.trace, fp, M) if M > 1 else None
        if M > 1:
            parts = [attn_one(len(a)) for a in np.array_split(np.arange(fp.num_seqs), M)]
        else:
            parts = [attn_one(fp.num_seqs)]
        t_attn = float(sum(parts))
        return PassContext(fp, self.now, parts, t_attn, t_attn + cost.t_dense_mlp(fp.tokens), cost.t_shared(fp.tokens), mb)

    def step_layer(self, ctx: "PassContext", layer: int) -> None:
        """The dense layers before MoE layer `layer`, then the MoE layer itself."""
        for _ in range(self._dense_before[layer]):
            self._gpu_block(ctx.t_dense, -1, "dense")
        self._run_layer(ctx.fp, layer, ctx.attn_parts, ctx.t_shared, ctx.t_attn, ctx.mb)

    def finish_pass(self, ctx: "PassContext") -> float:
        """Trailing dense layers and the LM head; returns the pass duration."""
        for _ in range(self._dense_before[self.L]):
            self._gpu_block(ctx.t_dense, -1, "dense")
        self._gpu_block(self.cost.t_head(ctx.fp.num_seqs), -1, "head")
        self.now += self.cost.pass_overhead_s  # the executor's fixed host time per pass (embedding, logits to host)
        if self.forecasts is not None:
            self.forecasts.drop_pending()
        duration = self.now - ctx.begin
        self.metrics.add_pass(ctx.fp.prefill, duration)
        return duration

    def run_pass(self, fp: ForwardPass) -> float:
        """Simulate one forward pass from `self.now`; returns its duration."""
        ctx = self.start_pass(fp)
        for layer in range(self.L):
            self.step_layer(ctx, layer)
        return self.finish_pass(ctx)

    def snapshot(self) -> tuple:
        """The mutable mechanism state (for search: restore with `restore`)."""
        return (self.residency.copy(), [Job(**vars(job)) for job in self.jobs], self.link_end, self.now,
                self.accounting.snapshot(), self.cpu_free, self.deferred_due, self.host_free)

    def restore(self, snap: tuple) -> None:
        residency, jobs, self.link_end, self.now, accounting, self.cpu_free, self.deferred_due, self.host_free = snap
        self.residency = residency.copy()
        self.jobs = [Job(**vars(job)) for job in jobs]
        self.accounting.restore(accounting)

    def run(self, passes: list[ForwardPass]) -> RunMetrics:
        for fp in passes:
            self.run_pass(fp)
        for job in self.jobs:  # the last layer's loads, never settled by a later gate
            self._commit(job)
        self.metrics.finish(self.now, self.forecasts.measured_hit_rates() if self.forecasts is not None else {})
        return self.metrics
