"""Discrete-event simulation of offloaded MoE inference: one GPU stream, one serial host->device
link with a software queue, a CPU expert pool; a scheduler's plans applied layer by layer.

Per MoE layer: attention on the GPU (split per micro-batch where the scheduler pipelines them) ->
gate -> the link settles (landed transfers become resident, started ones keep going, unstarted ones
are dropped) -> `scheduler.plan(state)` -> evictions, on-demand loads then prefetches are queued on
the link -> the GPU runs its experts as their weights become available (resident ones first, loads
in arrival order, a staging buffer reused once its previous expert is done), the CPU runs its
experts one after another -> the layer ends when both are done. Dense decoder layers and the LM
head run on the GPU. Without AsyncIO every copy is synchronous: it blocks the GPU stream, takes
`t_io_sync`, and prefetches finish inside the layer that issued them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from engine.sim.metrics import RunMetrics
from engine.sim.predictions import ForecastBook, LazyForecasts
from engine.sim.workload import ForwardPass, microbatch_loads
from engine.trace import RoutingTrace
from models.config import ModelConfig
from schedulers.base import LayerPlan, LayerState, OffloadScheduler, Phase, Transfer
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
class Event:
    """One busy interval of a lane, recorded for timelines and invariant checks."""

    lane: str  # "gpu" | "cpu" | "link"
    start: float
    end: float
    pass_index: int
    layer: int  # MoE layer (-1: dense layer / head)
    expert: int = -1  # -1: attention, dense MLP, head
    tokens: int = 0
    kind: str = ""  # gpu: attn | shared | expert | dense | head; link: ondemand (cached) | staged | prefetch


@dataclass
class PassContext:
    fp: ForwardPass
    begin: float
    attn_parts: list[float]
    t_attn: float
    t_dense: float  # one dense decoder layer (attention + MLP)
    t_shared: float
    mb: Optional[np.ndarray]


@dataclass
class SimOptions:
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
        self.resident = np.asarray(self.scheduler.initial_residency(), dtype=bool).copy()
        if self.resident.shape != (self.L, self.E):
            raise ValueError(f"initial residency has shape {self.resident.shape}, expected ({self.L}, {self.E})")
        if int(self.resident.sum()) > self.cache_slots:
            raise ValueError(f"{self.scheduler.name}: initial residency of {int(self.resident.sum())} experts exceeds "
                             f"the cache of {self.cache_slots}")
        self.n_resident = int(self.resident.sum())
        self.jobs: list[Job] = []  # scheduled on the link, in start order
        self.link_end = 0.0  # end of the last transfer that ran
        self.now = 0.0
        self.events: list[Event] = []
        self.metrics = RunMetrics(num_layers=self.L)
        self._prefetched: dict[int, set[int]] = {}
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
        self._recording = False
        self._pass = -1

    # ---- link --------------------------------------------------------------------------------
    def _settle(self, now: float) -> list[Job]:
        """Land finished transfers, keep started ones, drop those not started by `now` (returned)."""
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
        return dropped

    def _commit(self, job: Job) -> None:
        if job.counted:
            return
        job.counted = True
        self.link_end = max(self.link_end, job.end)
        self.metrics.add_transfer(job.end - job.start, job.prefetch, self.cost.expert_bytes)
        if job.prefetch:
            self._prefetched.setdefault(job.layer, set()).add(job.expert)
        opts = self.options
        if opts.record and (opts.record_passes is None or job.pass_index in opts.record_passes):
            kind = "prefetch" if job.prefetch else ("ondemand" if job.retain else "staged")
            self.events.append(Event("link", job.start, job.end, job.pass_index, job.layer, job.expert, kind=kind))

    def _land(self, job: Job) -> None:
        if job.retain and not self.resident[job.layer, job.expert]:
            self.resident[job.layer, job.expert] = True
            self.n_resident += 1

    def _reserved(self) -> int:
        return sum(1 for j in self.jobs if j.retain)

    # ---- one MoE layer -------------------------------------------------------------------------
    def _state(self, fp: ForwardPass, layer: int, dropped: list[Job], tokens: np.ndarray, t_attn_next: float,
               t_io: float, mb: Optional[np.ndarray]) -> LayerState:
        now = self.now
        inflight = tuple(Transfer(j.layer, j.expert, j.end - now, j.retain) for j in self.jobs)
        queued = tuple(Transfer(j.layer, j.expert, 0.0, j.retain) for j in dropped)
        alpha = max((j.end - now for j in self.jobs), default=0.0)
        predicted = LazyForecasts(self.forecasts, layer, fp.index, fp.rows, self.L) \
            if self.forecasts is not None else {}
        hit = self.forecasts.hit_rates() if self.forecasts is not None else {}
        reserved = sum(1 for j in self.jobs if j.retain)
        return LayerState(
            layer=layer, num_layers=self.L, phase=Phase.prefill if fp.prefill else Phase.decode,
            tokens=tokens, scores=fp.scores[layer], predicted=predicted, resident=self.resident,
            inflight=inflight, queued=queued, alpha_s=alpha, cache_slots=self.cache_slots,
            free_slots=self.cache_slots - self.n_resident - reserved, batch_tokens=fp.tokens,
            context_len=fp.context_len, hit_rate=hit, cost=self.cost, t_io_s=t_io, t_attn_next_s=t_attn_next,
            tokens_by_microbatch=None if mb is None else mb[:, layer])

    def _run_layer(self, fp: ForwardPass, layer: int, t_attn_parts: list[float], t_shared: float,
                   t_attn_next: float, mb: Optional[np.ndarray]) -> None:
        start = self.now
        # the executor's fixed host time per MoE layer (router output to the host, planning) delays the plan
        gates = np.cumsum(t_attn_parts) + start + self.cost.layer_overhead_s
        gate0, gate_last = float(gates[0]), float(gates[-1])
        rec = self._recording
        if rec:
            t = start
            for part in t_attn_parts:
                self.events.append(Event("gpu", t, t + part, self._pass, layer, kind="attn"))
                t += part
        self.now = gate0
        dropped = self._settle(gate0)
        tokens = fp.loads[layer]
        if self.forecasts is not None:
            self.forecasts.settle(layer, fp.rows)
        t_io = self.cost.t_io if self.options.async_io else self.cost.t_io_sync
        state = self._state(fp, layer, dropped, tokens, t_attn_next, t_io, mb)
        active_mask = tokens > 0
        available = state.available(layer)
        self.metrics.add_residency(fp.prefill, int(active_mask.sum()), int((available & active_mask).sum()))
        used = self._prefetched.pop(layer, set())
        if used:
            self.metrics.add_prefetch_outcome(sum(1 for e in used if tokens[e] > 0), len(used))
        plan = self.scheduler.plan(state)
        if not isinstance(plan, LayerPlan):
            raise TypeError(f"{self.scheduler.name}.plan returned {type(plan).__name__}, expected LayerPlan")
        if self.options.check_invariants:
            plan.validate(state)
        elif len(plan.cpu) + len(plan.gpu) != int(active_mask.sum()):
            plan.validate(state)  # raises with the reason

        for lay, e in plan.evict:
            self.resident[lay, e] = False
            self.n_resident -= 1
        issue = {}
        if mb is not None and len(t_attn_parts) > 1 and plan.ondemand:
            needs = mb[:, layer, list(plan.ondemand)] > 0  # [M, loads]
            first = np.where(needs.any(axis=0), needs.argmax(axis=0), len(gates) - 1)
            issue = dict(zip(plan.ondemand, gates[first].tolist()))
        sync = not self.options.async_io
        cursor = max(gate0, max((j.end for j in self.jobs), default=self.link_end))

        # GPU: shared experts, resident experts, experts landing from started transfers, then loads
        gpu_t = gate_last + t_shared
        busy = t_shared
        if rec and t_shared > 0:
            self.events.append(Event("gpu", gate_last, gpu_t, self._pass, layer, kind="shared"))
        gpu_set = plan.gpu
        landing = {j.expert: j.end for j in self.jobs if j.layer == layer}
        n_ready = len(gpu_set) - len(plan.ondemand)  # plans list resident / landing experts first
        if landing or any(e in landing for e in plan.ondemand) or set(gpu_set[n_ready:]) != set(plan.ondemand):
            loads = set(plan.ondemand)
            ready_now = [e for e in gpu_set if e not in loads and e not in landing]
        else:
            ready_now = list(gpu_set[:n_ready])
        if ready_now:
            m = tokens[ready_now]
            tg = self.cost.t_g_group(m)  # the resident experts run in one device call
            if rec:
                t = gpu_t
                for e, dt, mm in zip(ready_now, np.atleast_1d(tg), m):
                    self.events.append(Event("gpu", t, t + dt, self._pass, layer, e, int(mm), "expert"))
                    t += dt
            gpu_t += float(np.sum(tg))
            busy += float(np.sum(tg))
        for e in sorted((e for e in gpu_set if e in landing), key=lambda x: landing[x]):
            begin = max(gpu_t, landing[e])
            dt = self.cost.t_g(int(tokens[e]))
            gpu_t = begin + dt
            busy += dt
            if rec:
                self.events.append(Event("gpu", begin, gpu_t, self._pass, layer, e, int(tokens[e]), "expert"))
        n_loads = len(plan.ondemand)
        if n_loads:
            load_m = tokens[list(plan.ondemand)]
            load_tg = np.atleast_1d(self.cost.t_g(load_m)).tolist()
            load_m = load_m.tolist()
        new_jobs: list[Job] = []
        fast = n_loads > 8 and not sync and not issue and not rec
        if fast:  # back-to-back loads: the GPU end of load k is a running max; valid if no buffer stalls
            start0 = cursor if cursor > gate0 else gate0
            ends = start0 + t_io * np.arange(1, n_loads + 1)
            g = np.asarray(load_tg)
            cum = np.cumsum(g)
            finish = cum + np.maximum.accumulate(np.maximum(ends - (cum - g), gpu_t))
            staged = ~np.asarray(plan.retain, dtype=bool)
            order = np.flatnonzero(staged)
            S = self.staging_slots
            # a staged load may start only once the load S staged loads earlier finished on the GPU
            if order.size > S and np.any(ends[order[S:]] - t_io < finish[order[:-S]] - 1e-15):
                fast = False
            else:
                ends_l = ends.tolist()
                for idx, (e, keep) in enumerate(zip(plan.ondemand, plan.retain)):
                    new_jobs.append(Job(layer, e, ends_l[idx] - t_io, ends_l[idx], keep, False, self._pass))
                cursor = float(ends[-1])
                gpu_t = float(finish[-1])
                busy += float(cum[-1])
        staging_free = [0.0] * self.staging_slots
        n_staged = 0
        n_slots = self.staging_slots
        for idx in range(0 if fast else n_loads):
            e, keep = plan.ondemand[idx], plan.retain[idx]
            begin = cursor if cursor > gate0 else gate0
            if issue:
                begin = max(begin, issue.get(e, gate0))
            if not keep and staging_free[n_staged % n_slots] > begin:
                begin = staging_free[n_staged % n_slots]
            if sync and gpu_t > begin:
                begin = gpu_t
            end = begin + t_io
            cursor = end
            new_jobs.append(Job(layer, e, begin, end, keep, False, self._pass))
            g0 = gpu_t if gpu_t > end else end
            dt = load_tg[idx]
            gpu_t = g0 + dt
            busy += dt
            if rec:
                self.events.append(Event("gpu", g0, gpu_t, self._pass, layer, e, load_m[idx], "expert"))
            if not keep:
                staging_free[n_staged % n_slots] = gpu_t
                n_staged += 1
        for target, e in plan.prefetch:
            begin = max(cursor, gate0, gpu_t) if sync else max(cursor, gate0)
            end = begin + t_io
            cursor = end
            new_jobs.append(Job(target, e, begin, end, True, True, self._pass))
            if sync:
                gpu_t = end  # a blocking copy holds the stream and the host thread
        self.jobs.extend(new_jobs)
        if sync:  # synchronous copies complete inside this layer
            for job in new_jobs:
                self._commit(job)

        # CPU experts, one after another on the pool
        cpu_t = gate_last
        if plan.cpu:
            m = tokens[list(plan.cpu)]
            tc = np.atleast_1d(self.cost.t_c(m))
            if rec:
                t = cpu_t
                for e, dt, mm in zip(plan.cpu, tc, m):
                    self.events.append(Event("cpu", t, t + dt, self._pass, layer, e, int(mm), "expert"))
                    t += dt
            cpu_t += float(tc.sum()) + self.cost.cpu_dispatch_s  # one hand-over of the layer's CPU side
        end = max(gpu_t, cpu_t)
        if self.options.check_invariants:
            self._check_capacity(layer)
        self.metrics.add_layer(fp.prefill, layer, end - start, busy + sum(t_attn_parts), cpu_t - gate_last,
                               n_cpu=len(plan.cpu), n_gpu=len(gpu_set), n_ondemand=len(plan.ondemand),
                               n_prefetch=len(plan.prefetch))
        self.now = end

    def _check_capacity(self, layer: int) -> None:
        used = self.n_resident + self._reserved()
        if used > self.cache_slots or self.n_resident != int(self.resident.sum()):
            raise InvariantError(f"layer {layer}: {used} cache slots used of {self.cache_slots}")

    # ---- passes --------------------------------------------------------------------------------
    def _gpu_block(self, duration: float, layer: int, kind: str) -> None:
        if self._recording and duration > 0:
            self.events.append(Event("gpu", self.now, self.now + duration, self._pass, layer, kind=kind))
        self.now += duration

    def start_pass(self, fp: ForwardPass) -> "PassContext":
        """Per-pass constants (attention per micro-batch, dense layers, shared experts)."""
        self._pass = fp.index
        opts = self.options
        self._recording = opts.record and (opts.record_passes is None or fp.index in opts.record_passes)
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
        return (self.resident.copy(), self.n_resident, [Job(**vars(j)) for j in self.jobs], self.link_end, self.now,
                {k: set(v) for k, v in self._prefetched.items()})

    def restore(self, snap: tuple) -> None:
        resident, self.n_resident, jobs, self.link_end, self.now, prefetched = snap
        self.resident = resident.copy()
        self.jobs = [Job(**vars(j)) for j in jobs]
        self._prefetched = {k: set(v) for k, v in prefetched.items()}

    def run(self, passes: list[ForwardPass]) -> RunMetrics:
        for fp in passes:
            self.run_pass(fp)
        self._recording = self.options.record
        for job in self.jobs:  # the last layer's loads, never settled by a later gate
            self._commit(job)
        self.metrics.finish(self.now, self.forecasts.measured_hit_rates() if self.forecasts is not None else {})
        return self.metrics
