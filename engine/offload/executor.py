"""The offload executor: a MoE model run layer by layer with its experts in host memory.

At every MoE layer, after the gate: the link settles (landed transfers are resident; the started
one keeps going), the predictor forecasts the next layer(s), the scheduler returns a `LayerPlan`
from a `LayerState` filled from the real cache and link, and the executor carries it out:
evictions, the new transfer queue (on-demand loads in plan order, then prefetches), the CPU
experts on the torch worker, the GPU experts on the device as their weights are available
(resident ones at once, each on-demand load when it lands: OnIoDone), and the layer's output
when both sides are done (OnCpuGpuDone). Where the scheduler always keeps resident experts on the
device (`resident_on_device`), those start right after the gate, overlapping the planning; a
layer without on-demand loads computes its CPU side on the main thread once the device work is
dispatched (no hand-over to the worker: nothing on the link needs watching). A layer whose active experts
are all resident (with such a scheduler) is planned only once the next device call, its residual and the next
layer's attention and gate, is dispatched (`plan_behind_device`): its plan then decides only later layers'
transfers, and runs behind the device instead of in front of it. The Timer feeds
measured costs back into the cost model. What the plan does to the cache, the link queue and the
metrics is `engine.offload.accounting`, the same bookkeeping the simulator's layers go through.
Dense layers, attention, routers, shared experts and the LM head always run on the device.

With every routed expert resident and a scheduler that plans such layers as device work alone, a
pass has nothing to decide: it runs as one fused device call over the cache slots (`fuse_resident`),
and its routing still feeds the Counter, the residency metrics and the results.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.offload.accounting import Event, LayerAccounting, QueuedTransfer
from engine.offload.cache import DeviceExpertCache
from engine.offload.cpu_experts import CpuExperts
from engine.offload.deferral import deferred_pairs, split_routing
from engine.offload.forecasts import LazyForecasts, LiveForecastBook
from engine.offload.kernels import LayerKernels
from engine.offload.link import Job, TransferLink
from engine.offload.speculation import speculated_routing, working_plan
from engine.offload.metrics import RunMetrics
from engine.offload.settings import OffloadSettings
from engine.offload.stages import LayerLaps, StageTimes
from engine.offload.store import ExpertStore
from engine.offload.timer import Timer
from models.config import ModelConfig
from models.generation import bucket, left_pad, pad_id
from models.transformer import MoETransformer, init_cache, trims_last_layer
from predictors.base import LayerContext, Predictor
from schedulers.base import LayerPlan, LayerState, OffloadScheduler, Phase, Transfer
from schedulers.cost import CostModel


@dataclass
class OffloadOutput:
    tokens: np.ndarray  # int32 [B, max_new_tokens]
    lengths: np.ndarray  # int [B]
    prefill_s: float
    decode_s: float
    step_s: list[float]  # wall time of every decode pass
    metrics: RunMetrics
    events: list[Event] = field(default_factory=list)
    prefill_pass: int = 0  # pass index of the prefill in `events`; decode step k is pass prefill_pass + k
    last_logits: Optional[np.ndarray] = None  # float32 [B, V] of the first pass (tests compare it)
    all_logits: list[np.ndarray] = field(default_factory=list)  # per pass [B, V], when requested

    def sequences(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]


@dataclass
class LayerRun:
    """One MoE layer in progress on the executor."""

    layer: int  # MoE layer index
    phase: Phase
    hidden: jax.Array  # the experts' input [B, S, H] on the device
    host: np.ndarray  # the same on the host [B * S, H]
    experts: np.ndarray  # int64 [B * S, k]: routed experts (-1: padding rows)
    weights: np.ndarray  # float32 [B * S, k]
    live: np.ndarray  # bool [B * S]: rows of real tokens
    context: LayerContext  # what the forecasts made at this layer see
    start: float  # wall clock at the layer's sync point
    parts: list[jax.Array] = field(default_factory=list)  # partial outputs of the device work
    pinned: list[int] = field(default_factory=list)  # cache slots the outputs still read
    gpu_start: float = 0.0
    cpu_start: float = 0.0
    cpu_future: Optional[Future] = None  # the CPU side on the torch worker
    inline_cpu: bool = False  # the CPU side on the main thread, after the device work is dispatched
    cpu_routing: Optional[np.ndarray] = None  # int64 [B * S, k]: the pairs the layer's CPU side waits for (None: all)
    deferred_routing: Optional[np.ndarray] = None  # Expert Deferral: the CPU pairs landing one MoE layer late


# one float32 add of two partial outputs (a jax or host array each): the layer's parts summed in order
_add = jax.jit(jnp.add)


def link_view(active: Optional[Job], resident: np.ndarray, t_io: float, now: float
              ) -> tuple[tuple[Transfer, ...], float]:
    """The transfer on the link as a plan must see it, and alpha (eq. 3: link time still owed).

    Judged against the residency snapshot `resident` (bool [L, E]) only: a transfer that lands after
    the snapshot still counts as in flight, or the plan would see its expert neither resident nor
    landing and load it a second time. Failed transfers and finished staging loads are not in flight.
    """
    if active is None or resident[active.layer, active.expert]:
        return (), 0.0
    done = active.done.is_set()
    if done and (active.error is not None or not active.retain):
        return (), 0.0
    alpha = 0.0 if done else max(t_io - (now - (active.started_at or now)), 0.0)
    return (Transfer(active.layer, active.expert, alpha, active.retain),), alpha


def new_cache(cfg: ModelConfig, settings: OffloadSettings, dtype: Any, store: Optional[ExpertStore] = None
              ) -> DeviceExpertCache:
    """The device expert cache `settings` ask for, in the model's dtype (block bytes for a quantized `store`)."""
    widths = store.slot_widths() if store is not None and store.quantized else None
    return DeviceExpertCache(cfg, settings.slots(), settings.staging_slots, dtype, block_widths=widths)


def padded_shapes(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> tuple[int, int, int]:
    """(batch, padded prompt length, KV-cache capacity) that `OffloadExecutor.generate` runs `prompts` at: the
    shapes its passes compile for (a batch of other shapes compiles anew)."""
    P = bucket(max(map(len, prompts)), 16)
    return len(prompts), P, bucket(P + max_new_tokens, 64)


class OffloadExecutor:
    """Greedy generation of a MoE model whose routed experts live in an `ExpertStore`."""

    def __init__(self, model: MoETransformer, store: ExpertStore, scheduler: OffloadScheduler, cost: CostModel,
                 settings: OffloadSettings, predictors: Optional[dict[int, Predictor]] = None,
                 row_lookup: Optional[Callable[[np.ndarray, np.ndarray], np.ndarray]] = None,
                 fault: Optional[Callable[[Job, str], None]] = None, cache: Optional[DeviceExpertCache] = None):
        """`cache`: device slots to reuse (emptied first) instead of allocating new ones, so executors run one
        after another (the Counter's profiling run, then the measured run) never hold two caches at once."""
        self.cfg = cfg = model.cfg
        self.model = model
        self.store = store
        self.scheduler = scheduler
        self.cost = cost
        self.settings = settings
        self.L, self.E, self.k = len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok
        self.moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}
        dtype = model.run_dtype
        self._owns_cache = cache is None
        self.cache = cache if cache is not None else new_cache(cfg, settings, dtype, store)
        self.cache.reset()
        if (self.cache.cache_slots, len(self.cache.slots) - self.cache.cache_slots) != (settings.slots(),
                                                                                       settings.staging_slots):
            raise ValueError(f"cache of {self.cache.cache_slots} + {len(self.cache.slots) - self.cache.cache_slots} "
                             f"slots given to an executor of {settings.cache_slots} + {settings.staging_slots}")
        self.timer = Timer(cost, store.expert_bytes, update_cost=settings.timer_updates_cost)
        self.accounting = LayerAccounting(self.L, store.expert_bytes)
        self.link = TransferLink(store, self.cache, settings.chunks, synchronous=not settings.async_io,
                                 retries=settings.retries, on_done=self._on_io_done, fault=fault)
        self.cpu = CpuExperts(store, settings.cpu_threads)
        self.formats = tuple(store.formats[m] for m in range(self.L)) if store.quantized else None
        self.kernels = LayerKernels(model, formats=self.formats)
        self.book = LiveForecastBook(predictors or {}, self.k, self.E)
        for predictor in (predictors or {}).values():  # online learning compiles now, not inside a decode step
            getattr(predictor, "warm_up", lambda: None)()
        self.row_lookup = row_lookup
        self._dummies = self._fillers(store)
        self.expert_tokens = np.zeros((self.L, self.E), np.int64)  # tokens routed per expert (the Counter)
        self.stages = StageTimes()  # where each MoE layer's wall time went (planning time per policy among it)
        self.seq_offset = 0  # sequence id of the next batch's first row (row_lookup into a reference trace)
        self._t0 = time.perf_counter()
        self._moe_wall = 0.0  # wall time of the current pass's MoE layers (the rest is the pass's overhead)
        self.speculated: list[tuple[int, int, tuple[int, ...]]] = []  # (pass, MoE layer, plan.speculate)
        self._deferred: Optional[Future] = None  # Expert Deferral: the last MoE layer's late CPU output, on the worker
        self._preload(np.asarray(scheduler.initial_residency(), bool))

    # ---- setup / teardown -----------------------------------------------------------------------------
    def _preload(self, residency: np.ndarray) -> None:
        """The hot-expert table: load the scheduler's initial residency before serving."""
        if residency.shape != (self.L, self.E):
            raise ValueError(f"{self.scheduler.name}: initial residency shape {residency.shape} != ({self.L}, {self.E})")
        if int(residency.sum()) > self.cache.cache_slots:
            raise ValueError(f"{self.scheduler.name}: hot table of {int(residency.sum())} experts exceeds the "
                             f"{self.cache.cache_slots} cache slots")
        jobs = [Job(int(l), int(e), self.cache.reserve(int(l), int(e), staging=False), retain=True, prefetch=False)
                for l, e in zip(*np.nonzero(residency))]
        with self.timer.window():  # the first writes compile the slot update
            self.link.submit(jobs)
            for job in jobs:
                self.link.wait(job.layer, job.expert)
        self.link.completed.clear()

    def _fillers(self, store: ExpertStore) -> list[tuple[jax.Array, jax.Array]]:
        """Per MoE layer, the zero (gate|up, down) arrays padding its expert call's slot list to E: one pair per row
        width, shared by the layers of that width (a quantized layer's slots hold its own widths; float slots one
        pair), looked up per layer here rather than in every expert call. Committed to the cache's device like the
        slots: an uncommitted filler would make every pattern of (slot, filler) positions a new jit cache entry (a
        compile in the middle of serving)."""
        per_layer = [store.layer_widths(m) if store.quantized else None for m in range(self.L)]
        dtype = self.cache.gate_up[0].dtype
        pairs = {w: tuple(jax.device_put(jnp.zeros(shape, dtype), self.cache.sharding)  # type: ignore[misc]
                          for shape in self.cache.slot_shapes(w)) for w in set(per_layer)}
        return [pairs[w] for w in per_layer]  # type: ignore[misc]

    def close(self) -> None:
        """Stop the link and the CPU worker and give the device slots back (an executor built next, e.g.
        after the profiling run, must not find this one's cache still holding device memory)."""
        self.link.close()
        self.cpu.close()
        if self._owns_cache:
            self.cache.free()
        self._dummies = []

    def __enter__(self) -> "OffloadExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- events ---------------------------------------------------------------------------------------
    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _on_io_done(self, job: Job) -> None:
        """OnIoDone: a transfer landed (called from the I/O thread)."""
        self.timer.transfer(job.seconds)
        started = job.started_at if job.started_at is not None else job.issued_at
        done = job.done_at if job.done_at is not None else time.perf_counter()
        self.accounting.transfer(job, started - self._t0, done - self._t0, self.accounting.pass_index,
                                 self.accounting.recording)

    # ---- one MoE layer ---------------------------------------------------------------------------------
    def _moe_layer(self, block: int, hidden: jax.Array, experts_d: jax.Array, weights_d: jax.Array, phase: Phase,
                   valid_flat: np.ndarray, seqs: np.ndarray, pos: np.ndarray, tokens: np.ndarray, context_len: int,
                   begin: float, last_rows: bool = False
                   ) -> tuple[list[jax.Array], list[int], Optional[Callable[[jax.Array], None]]]:
        """Plan the MoE layer of decoder layer `block` (its gate has run) and compute its experts: (partial
        outputs, pinned slots, the layer's plan to make once the call consuming its output is dispatched, or None
        when it was planned already: `_plan_later`).

        `begin`: when the layer's attention call was dispatched; the wall time from there to the issued
        plan, minus the modelled attention, is the layer's fixed host overhead (the Timer's sample). `last_rows`: the
        layer runs each row's last token only (`trims_last_layer`; the flat arrays are those rows')."""
        laps = self.stages.laps(phase)
        experts_d.block_until_ready()  # the device's attention and gate
        laps.lap("device_sync")
        run = self._route(self.moe_index[block], phase, hidden, experts_d, weights_d, valid_flat, seqs, pos, tokens,
                          last_rows)
        laps.lap("route")
        early = self._start_resident(run)
        laps.lap("dispatch")
        if self._plan_behind(run, early):
            later = self._plan_later(run, early, context_len, laps, begin)
            return self._combine(run), run.pinned, later
        state, plan = self._plan(run, early, context_len, laps)
        if phase is Phase.decode:  # prefill's attention is far from its model; decode is what the overhead serves
            self.timer.layer_overhead(time.perf_counter() - begin - state.t_attn_next_s)
        self.accounting.open_layer(state)
        plan = self._speculate(run, plan, early)
        self._start_cpu(run, plan)
        laps.lap("bookkeeping")
        self._compute_ready(run, plan, early, laps)
        self._compute_loads(run, plan, laps)
        gpu_busy, cpu_busy = self._join(run, plan, laps)
        parts = self._combine(run)
        self.link.flush()  # no AsyncIO: prefetches finish inside the layer that issued them
        laps.lap("transfer_wait")
        self._close_layer(run, plan, gpu_busy, cpu_busy)
        laps.lap("bookkeeping")
        laps.close(plan)
        return parts, run.pinned, None

    def _route(self, layer: int, phase: Phase, hidden: jax.Array, experts_d: jax.Array, weights_d: jax.Array,
               valid: np.ndarray, seqs: np.ndarray, pos: np.ndarray, tokens: np.ndarray, last_rows: bool = False
               ) -> LayerRun:
        """The layer's routing on the host (its sync point): the forecasts made for it are scored, the Counter
        counts it, and the forecasts made here get their context. With `last_rows` the layer routes each row's last
        token only: the forecasts made for it (over the pass's tokens, row by row) have no truth to score against."""
        start = time.perf_counter()
        # the sync point of the layer: the three arrays fetched in one call (their copies overlap)
        experts_h, weights_h, host = jax.device_get((experts_d, weights_d, hidden))
        experts = np.where(valid[:, None], experts_h, -1).astype(np.int64)  # padding rows route nowhere
        weights = np.asarray(weights_h).astype(np.float32)
        host = host.reshape(-1, self.cfg.hidden_size)
        if valid.all():  # a decode pass: every row a real token, no selection to copy
            live_experts, live_weights, live_host = experts, weights, host
            live_seqs, live_pos, live_tokens = seqs, pos, tokens
        else:
            live_experts, live_weights, live_host = experts[valid], weights[valid], host[valid]
            live_seqs, live_pos, live_tokens = seqs[valid], pos[valid], tokens[valid]
        if last_rows:
            self.book.discard(layer)
        else:
            self.book.settle_live(layer, live_experts)
        self.expert_tokens[layer] += np.bincount(live_experts.reshape(-1), minlength=self.E)
        rows = self.row_lookup(live_seqs, live_pos) if self.row_lookup is not None else None
        context = LayerContext(layer=layer, step=self.accounting.pass_index, experts=live_experts,
                               weights=live_weights, hidden=live_host.astype(np.float32), tokens=live_tokens,
                               seq=live_seqs, pos=live_pos, rows=rows)
        self.book.begin_layer(context)
        return LayerRun(layer, phase, hidden, host, experts, weights, valid, context, start)

    def _start_resident(self, run: LayerRun) -> list[int]:
        """Where the scheduler keeps resident experts on the device, start them now (overlapping the planning)."""
        run.gpu_start = time.perf_counter()
        if not self.scheduler.resident_on_device:
            return []
        early = [int(expert) for expert in np.unique(run.experts[run.live])
                 if expert >= 0 and self.cache.is_resident(run.layer, int(expert))]
        if early:
            run.pinned += self._dispatch(run, early)
        return early

    def _plan(self, run: LayerRun, early: list[int], context_len: int, laps: LayerLaps
              ) -> tuple[LayerState, LayerPlan]:
        """The plan point, the link held (its queue stays as the scheduler sees it): state, plan, issue."""
        with self.link.hold():
            state = self._snapshot(run, context_len, laps)
            plan = self._decide(run, state, early, run.parts, laps)
            self._issue(run.layer, plan)
        laps.lap("issue")
        return state, plan

    def _snapshot(self, run: LayerRun, context_len: int, laps: LayerLaps) -> LayerState:
        """The state the plan is made from (the link held); what is still queued is dropped by this plan."""
        queued = self.link.queued()
        state = self._state(run, queued, context_len)
        self.accounting.settle_prefetches(queued)
        laps.lap("state")
        return state

    def _decide(self, run: LayerRun, state: LayerState, early: list[int], device: Sequence[jax.Array],
                laps: LayerLaps) -> LayerPlan:
        """The scheduler's plan (the `plan` lap: its call alone; exposed unless work in `device` still runs), checked."""
        plan = self.scheduler.plan(state)
        laps.plan_done(device_busy=not all(a.is_ready() for a in device))
        plan = self.accounting.check(self.scheduler, state, plan, validate=self.settings.validate_plans)
        if not set(early) <= set(plan.gpu):
            raise RuntimeError(f"{self.scheduler.name}: resident_on_device, but the plan of MoE layer {run.layer} "
                               f"moves resident experts {sorted(set(early) - set(plan.gpu))} off the device")
        laps.lap("bookkeeping")
        return plan

    def _plan_behind(self, run: LayerRun, early: list[int]) -> bool:
        """Whether the layer's plan may wait until its output is on its way (`OffloadSettings.plan_behind_device`):
        every active expert resident and started on the device (a scheduler that keeps them there has one plan for
        this layer's experts, all on the device; it decides only later layers' transfers), no deferred output to
        join (Expert Deferral)."""
        if not (self.settings.plan_behind_device and self.scheduler.resident_on_device and self._deferred is None):
            return False
        active = np.unique(run.experts[run.live])
        return len(early) == int((active >= 0).sum())

    def _plan_later(self, run: LayerRun, early: list[int], context_len: int, laps: LayerLaps, begin: float
                    ) -> Callable[[jax.Array], None]:
        """A layer planned behind the device: its state is taken now (the link held until the plan is issued, so
        the queue stays as the scheduler sees it), the plan made once `after`, the call that consumes the layer's
        output (the next layer's attention and gate), is dispatched. The plan must be the layer's experts all on
        the device (`_plan_behind`); its evictions and transfers are issued as any plan's."""
        hold = self.link.hold()
        hold.__enter__()
        try:
            state = self._snapshot(run, context_len, laps)
        except BaseException:
            hold.__exit__(None, None, None)
            raise
        handover = time.perf_counter()

        def finish(after: jax.Array) -> None:
            laps.skip()  # the dispatch of `after` is the next layer's
            laps.behind = True
            try:
                plan = self._decide(run, state, early, (after,), laps)
                if plan.cpu or plan.ondemand or plan.defer or plan.speculate is not None or \
                        set(plan.gpu) != set(early):
                    raise RuntimeError(f"{self.scheduler.name}: MoE layer {run.layer} has every active expert resident "
                                       f"{sorted(early)} and keeps resident experts on the device, but its plan is "
                                       f"cpu={plan.cpu} gpu={plan.gpu} ondemand={plan.ondemand} defer={plan.defer} "
                                       f"speculate={plan.speculate}")
                self._issue(run.layer, plan)
            finally:
                hold.__exit__(None, None, None)
            laps.lap("issue")
            self.link.flush()  # no AsyncIO: the plan's transfers move before the next layer's plan point
            laps.lap("transfer_wait")
            if run.phase is Phase.decode:
                self.timer.layer_overhead(handover - begin - state.t_attn_next_s)
            self.accounting.open_layer(state)
            self._close_layer(run, plan, handover - run.gpu_start, 0.0, handover - run.start)
            laps.lap("bookkeeping")
            laps.close(plan)

        return finish

    def _state(self, run: LayerRun, queued: list[Job], context_len: int) -> LayerState:
        experts, weights = run.experts[run.live], run.weights[run.live]
        rows, seq_len = run.hidden.shape[:2]
        tokens = np.bincount(experts.reshape(-1), minlength=self.E).astype(np.int64)
        scores = np.bincount(experts.reshape(-1), weights=weights.reshape(-1), minlength=self.E)
        resident = self.cache.resident_mask()  # one snapshot: a transfer landing after it still counts as in flight
        inflight, alpha = link_view(self.link.active(), resident, self.cost.t_io, time.perf_counter())
        waiting = tuple(Transfer(job.layer, job.expert, self.cost.t_io, job.retain) for job in queued)
        reserved_by_queue = sum(1 for job in queued if job.slot >= 0 and not self.cache.slots[job.slot].staging)
        phase = run.phase
        return LayerState(layer=run.layer, num_layers=self.L, phase=phase, tokens=tokens, scores=scores,
                          predicted=LazyForecasts(self.book, run.layer, self.accounting.pass_index, run.context.rows,
                                                  self.L),
                          resident=resident, inflight=inflight, queued=waiting, alpha_s=alpha,
                          cache_slots=self.cache.cache_slots,
                          free_slots=self.cache.free_cache_slots() + reserved_by_queue,
                          batch_tokens=int(run.live.sum()), context_len=context_len, hit_rate=self.book.hit_rates(),
                          cost=self.cost, t_io_s=self.cost.t_io if self.settings.async_io else self.cost.t_io_sync,
                          t_attn_next_s=self.cost.t_attn(rows, context_len, prefill=phase is Phase.prefill,
                                                         prompt_len=seq_len))

    def _issue(self, layer: int, plan: LayerPlan) -> None:
        """The plan's evictions, then the new link queue: held prefetches, on-demand loads in order, prefetches."""
        queue = self.accounting.issue(layer, plan, self.cache)
        self.link.submit([])  # drop unstarted transfers of earlier plans (their slots come back; held ones are re-queued)
        self.link.submit([self._job(item) for item in queue])

    def _job(self, item: QueuedTransfer) -> Job:
        """A link job of the plan's queue, its cache slot reserved (a staged load takes a buffer when it starts)."""
        slot = self.cache.reserve(item.layer, item.expert, staging=False) if item.retain else -1
        return Job(item.layer, item.expert, slot, retain=item.retain, prefetch=item.prefetch)

    def _speculate(self, run: LayerRun, plan: LayerPlan, early: list[int]) -> LayerPlan:
        """Speculative execution (`engine.offload.speculation`): the layer computes the speculated routing from here
        on, with the plan less the speculated experts no pair uses. The experts started early (resident) computed
        their routed pairs, all hits (every resident expert is speculated); the pairs substituted onto them are one
        more device call over those pairs only."""
        if plan.speculate is None:
            return plan
        executed = speculated_routing(run.experts, plan.speculate)
        moved = np.where(executed != run.experts, executed, -1)
        onto_early = np.where(np.isin(moved, early), moved, -1)
        if (onto_early >= 0).any():
            out, slots = self._device_experts(run.hidden, onto_early, run.weights, early, run.layer)
            run.parts.append(out)
            run.pinned += slots
        run.experts = executed
        self.speculated.append((self.accounting.pass_index, run.layer, plan.speculate))
        return working_plan(plan, executed, self.E)

    def _start_cpu(self, run: LayerRun, plan: LayerPlan) -> None:
        """The CPU side: the torch worker starts now, unless no on-demand load is to be waited for: then the main
        thread computes it itself once the device work is dispatched (a hand-over to the worker costs more than a small layer's CPU work)."""
        run.inline_cpu = bool(plan.cpu) and not plan.ondemand
        run.cpu_routing = run.experts
        if plan.defer:  # Expert Deferral: the deferred pairs go to the worker once the layer's own CPU side is done
            run.cpu_routing, run.deferred_routing = split_routing(
                run.experts, deferred_pairs(run.experts, run.weights, plan.cpu, plan.defer))
        if plan.cpu and not run.inline_cpu:
            run.cpu_future = self.cpu.submit(run.layer, run.host, run.cpu_routing, run.weights, list(plan.cpu))
        run.cpu_start = time.perf_counter()

    def _compute_ready(self, run: LayerRun, plan: LayerPlan, early: list[int], laps: LayerLaps) -> None:
        """The device experts that need no load (landing prefetches are waited for; resident ones are there)."""
        skip = set(plan.ondemand) | set(early)
        ready = [expert for expert in plan.gpu if expert not in skip]
        for expert in ready:
            if not self.cache.is_resident(run.layer, expert):
                self.link.wait(run.layer, expert)
        laps.lap("transfer_wait")
        if not early:
            run.gpu_start = time.perf_counter()
        if ready:
            run.pinned += self._dispatch(run, ready)
        laps.lap("dispatch")

    def _compute_loads(self, run: LayerRun, plan: LayerPlan, laps: LayerLaps) -> None:
        """Each on-demand load computed when it lands (OnIoDone); a staging buffer goes back to the link once
        its compute is done."""
        for expert, retain in zip(plan.ondemand, plan.retain):
            self.link.wait(run.layer, expert)
            laps.lap("transfer_wait")
            # a sample times the call alone: device calls run in order (earlier queued work would count), and
            # where the device is the host the CPU experts' worker shares its cores. Only decode calls are
            # samples: the cost model takes them as per-call dispatch, and a prefill call runs the grouped
            # kernel over every row of the pass (many times a decode call's time)
            timed = run.phase is Phase.decode and all(part.is_ready() for part in run.parts) and \
                (run.cpu_future is None or run.cpu_future.done())
            started = time.perf_counter()
            slots = self._dispatch(run, [expert])
            laps.lap("dispatch")
            if retain:
                run.pinned += slots
                continue
            run.parts[-1].block_until_ready()
            laps.lap("device_compute")
            if timed:
                self.timer.gpu(int((run.experts == expert).sum()), time.perf_counter() - started)
            self.cache.unpin(slots)
            self.cache.release(slots[0])

    def _dispatch(self, run: LayerRun, chosen: Sequence[int]) -> list[int]:
        """Dispatch the device computation of experts `chosen`; returns their (pinned) slots."""
        out, slots = self._device_experts(run.hidden, run.experts, run.weights, chosen, run.layer)
        run.parts.append(out)
        return slots

    def _device_experts(self, hidden: jax.Array, experts: np.ndarray, weights: np.ndarray, chosen: Sequence[int],
                        layer: int) -> tuple[jax.Array, list[int]]:
        """Dispatch the device computation of experts `chosen` of MoE layer `layer` (their slots pinned)."""
        slots = [self.cache.slot_of(layer, expert) for expert in chosen]
        self.cache.pin(slots)  # type: ignore[arg-type]
        gate_up, down = self.cache.arrays()
        local = np.full(self.E, -1, np.int32)
        local[list(chosen)] = np.arange(len(chosen), dtype=np.int32)
        index = np.where(experts >= 0, local[np.maximum(experts, 0)], -1)
        filler, blank = self.E - len(slots), self._dummies[layer]
        gate_up_slots = [gate_up[slot] for slot in slots] + [blank[0]] * filler  # type: ignore[index]
        down_slots = [down[slot] for slot in slots] + [blank[1]] * filler  # type: ignore[index]
        out = self.kernels.experts(hidden, index, weights, gate_up_slots, down_slots, layer)
        return out, slots  # type: ignore[return-value]

    def _join(self, run: LayerRun, plan: LayerPlan, laps: LayerLaps) -> tuple[float, float]:
        """OnCpuGpuDone: both sides of the layer done; returns their busy times (device, CPU)."""
        cpu_out, cpu_busy = None, 0.0
        if run.inline_cpu:
            run.cpu_start = time.perf_counter()
            cpu_out = self.cpu.compute(run.layer, run.host, run.cpu_routing, run.weights, list(plan.cpu))
            cpu_busy = time.perf_counter() - run.cpu_start
            laps.lap("cpu_experts")
        gpu_busy = 0.0
        if run.parts:  # (after an inline CPU side, the device side is seen done no earlier than the CPU side)
            jax.block_until_ready(run.parts)
            gpu_busy = time.perf_counter() - run.gpu_start
            laps.lap("device_compute")
        if run.cpu_future is not None:
            cpu_out = run.cpu_future.result()
            cpu_busy = time.perf_counter() - run.cpu_start
            laps.lap("cpu_experts")
        if cpu_out is not None:
            run.parts.append(cpu_out)  # a host array: `_combine` adds it in one device call
            self._time_cpu(cpu_busy, gpu_busy)
            laps.lap("bookkeeping")
        self._defer(run, plan, laps)
        return gpu_busy, cpu_busy

    def _defer(self, run: LayerRun, plan: LayerPlan, laps: LayerLaps) -> None:
        """Expert Deferral: the last MoE layer's deferred output joins this layer's (it lands in the residual with
        this layer's experts), and this layer's deferred pairs start on the CPU worker, which computes them while
        the device runs on (the next layer's attention and device experts)."""
        if self._deferred is not None:
            run.parts.append(self._deferred.result())
            self._deferred = None
            laps.lap("cpu_experts")
        if run.deferred_routing is not None:
            self._deferred = self.cpu.submit(run.layer, run.host, run.deferred_routing, run.weights, list(plan.cpu))

    def _time_cpu(self, cpu_busy: float, gpu_busy: float) -> None:
        """The Timer's CPU samples of the layer, and its hand-over when the CPU side was the critical path."""
        for token_count, seconds in self.cpu.timings:
            self.timer.cpu(token_count, seconds)
        if cpu_busy > gpu_busy:  # the CPU side was the critical path: what it took beyond its compute
            self.timer.cpu_dispatch(cpu_busy - sum(seconds for _, seconds in self.cpu.timings))  # is the hand-over
        self.cpu.timings.clear()

    def _combine(self, run: LayerRun) -> list[jax.Array]:
        """The layer's partial outputs as one: the fused residual call keeps one compiled signature (its pytree
        would otherwise change with the plan's call count)."""
        parts = run.parts
        if not parts:
            parts.append(np.zeros((run.host.shape[0], self.cfg.hidden_size), np.float32))
        while len(parts) > 1:  # left to right, as the in-memory sum; a jitted add is ~5x cheaper to call than jnp's
            parts[:2] = [_add(parts[0], parts[1])]
        if isinstance(parts[0], np.ndarray):  # the residual call takes device arrays (one compiled signature)
            parts[0] = jnp.asarray(parts[0])
        return parts

    def _close_layer(self, run: LayerRun, plan: LayerPlan, gpu_busy: float, cpu_busy: float,
                     seconds: Optional[float] = None) -> None:
        """The layer's metrics (`seconds`: its duration, by default until now) and, in recorded passes, its device
        and CPU busy intervals."""
        seconds = time.perf_counter() - run.start if seconds is None else seconds
        self.accounting.close_layer(run.phase is Phase.prefill, run.layer, plan, seconds, gpu_busy, cpu_busy)
        origin = self._t0
        if gpu_busy:
            self.accounting.record("gpu", run.gpu_start - origin, run.gpu_start - origin + gpu_busy, run.layer,
                                   kind="expert")
        if cpu_busy:
            self.accounting.record("cpu", run.cpu_start - origin, run.cpu_start - origin + cpu_busy, run.layer,
                                   kind="expert")

    # ---- a forward pass --------------------------------------------------------------------------------
    def _can_fuse(self) -> bool:
        """Nothing to plan: every routed expert resident, the link idle, device work the only possible plan."""
        return (self.settings.fuse_resident and self.scheduler.resident_on_device
                and self.link.active() is None and not self.link.queued() and bool(self.cache.resident_mask().all()))

    def _resident_slots(self) -> tuple[tuple, tuple]:
        """The cache arrays as (gate_up, down)[m][e]: expert e of MoE layer m (every one resident)."""
        gate_up, down = self.cache.arrays()
        slots = [[self.cache.slot_of(layer, e) for e in range(self.E)] for layer in range(self.L)]
        return (tuple(tuple(gate_up[s] for s in row) for row in slots),  # type: ignore[index]
                tuple(tuple(down[s] for s in row) for row in slots))  # type: ignore[index]

    def _account_fused(self, prefill: bool, experts: Sequence[np.ndarray]) -> None:
        """Counter and residency metrics of fused passes: per MoE layer experts [passes, tokens, k] (all resident; a
        prefill's last decoder layer routes fewer tokens: `trims_last_layer`)."""
        passes = experts[0].shape[0]
        used = np.zeros((passes, self.L, self.E), bool)
        for layer, routed in enumerate(experts):
            np.add.at(self.expert_tokens[layer], routed.reshape(-1), 1)
            used[np.arange(passes)[:, None, None], layer, routed] = True
        self.accounting.fused_passes(prefill, passes, int(used.sum()))

    def _fused_forward(self, kv: Any, tokens: np.ndarray, positions: np.ndarray, valid: np.ndarray,
                       phase: Phase) -> tuple[jax.Array, Any]:
        """A pass over a full cache as one device call; its routing is accounted afterwards."""
        self.accounting.pass_index += 1
        t = time.perf_counter()
        logits, kv, routed = self.kernels.resident_pass(*self._resident_slots(), kv, tokens, positions, valid,
                                                        empty_cache=phase is Phase.prefill)  # `generate`: fresh
        routed = [np.asarray(r) for r in jax.device_get(routed)]
        live = [valid.reshape(-1) if len(r) == valid.size else valid[:, -1] for r in routed]  # [B, k]: the last tokens
        self._account_fused(phase is Phase.prefill, [r[None, m] for r, m in zip(routed, live)])
        self.accounting.record("gpu", t - self._t0, self._now(), -1, -1, int(valid.sum()), "fused")
        return logits, kv

    def _fused_decode(self, kv: Any, tokens: np.ndarray, next_pos: np.ndarray, done: np.ndarray, n_steps: int,
                      eos: int, pad: int, keep_logits: bool) -> tuple[np.ndarray, list[float], Optional[np.ndarray]]:
        """The remaining decode steps over a full cache in one device loop (nothing to plan on the way):
        (tokens [B, steps run], seconds per step (the loop's mean), logits [steps, B, V] when kept)."""
        t = time.perf_counter()
        out, steps, (routed, logits) = self.kernels.resident_decode(
            *self._resident_slots(), kv, tokens, next_pos.astype(np.int32), done, n_steps, eos, pad, keep_logits)
        n = int(steps)
        out = np.asarray(out)[:, 1:n + 1]
        seconds = time.perf_counter() - t
        routed = np.asarray(routed)[:n]
        self._account_fused(False, [routed[:, layer] for layer in range(self.L)])
        self.accounting.pass_index += 1  # the loop's first pass: its event stands for the whole loop
        self.accounting.record("gpu", t - self._t0, self._now(), -1, -1, len(tokens) * n, "fused decode")
        self.accounting.pass_index += n - 1
        return out, [seconds / n] * n, None if logits is None else np.asarray(logits)[:n]

    def _forward(self, kv: Any, tokens: np.ndarray, positions: np.ndarray, valid: np.ndarray, phase: Phase,
                 seqs: np.ndarray, context_len: int) -> tuple[jax.Array, Any]:
        """One forward pass; a MoE layer's residual is finished in the same call as the next layer's gate."""
        self.accounting.pass_index += 1
        self._moe_wall = 0.0
        B, S = tokens.shape
        # a prefill fills a fresh cache (`generate`): it attends the new tokens only, as the in-memory model does
        ai, kv = self.kernels.prepare(kv, jnp.asarray(positions), jnp.asarray(valid), empty_cache=phase is Phase.prefill)
        x = self.kernels.embed_tokens(jnp.asarray(tokens))
        flat = (valid.reshape(-1), np.repeat(seqs, S), positions.reshape(-1), tokens.reshape(-1))
        # the last decoder layer's feed-forward on each row's last token only, as the in-memory model's (its experts
        # must see the same rows: a grouped kernel's sums depend on its rows)
        trim = trims_last_layer(True, False, S)
        last_flat = (valid[:, -1], seqs, positions[:, -1], tokens[:, -1])
        layers = list(kv.layers)
        pending: Optional[tuple] = None  # MoE layer awaiting its residual: (layer, g, parts, pinned, plan later)
        for i, layer in enumerate(self.model.layers):
            t = time.perf_counter()
            last_rows = trim and i == len(self.model.layers) - 1
            if not layer.is_moe:
                if pending is not None:
                    x = self.kernels.back(pending[0], x, pending[1], pending[2])
                    pending = self._release(pending, x)
                x, layers[i] = self.kernels.dense(i, x, ai, layers[i], last_rows)
                continue
            if pending is None:
                x, layers[i], g, experts, weights = self.kernels.front(i, x, ai, layers[i], last_rows)
            else:
                x, layers[i], g, experts, weights = self.kernels.back_front(pending[0], x, pending[1], pending[2], i,
                                                                            ai, layers[i], last_rows)
                pending = self._release(pending, experts)
            if self.accounting.recording:
                experts.block_until_ready()
                self.accounting.record("gpu", t - self._t0, self._now(), self.moe_index[i], kind="attn")
            parts, pinned, later = self._moe_layer(i, g, experts, weights, phase, *(last_flat if last_rows else flat),
                                                   context_len, t, last_rows)
            self._moe_wall += time.perf_counter() - t
            pending = (i, g, parts, pinned, later)
        if pending is not None:
            x = self.kernels.back(pending[0], x, pending[1], pending[2])
            self._release(pending, x)
        if self._deferred is not None:  # LayerPlan.validate refuses a deferral at the last MoE layer
            raise RuntimeError(f"{self.scheduler.name}: a deferred expert output of the last MoE layer has no layer to "
                               "land in")
        self.book.drop_pending()
        kv = type(kv)(layers=layers, valid=kv.valid, positions=kv.positions, index=kv.index + S)
        return self.kernels.logits(x[:, -1]), kv

    def _modelled_outside_moe(self, rows: int, context_len: int) -> float:
        """What the cost model charges a decode pass outside its MoE layers: dense layers and the head."""
        n_dense = self.cfg.num_hidden_layers - self.L
        dense = n_dense * (self.cost.t_attn(rows, context_len) + self.cost.t_dense_mlp(rows)) if n_dense else 0.0
        return dense + self.cost.t_head(rows)

    def _release(self, pending: tuple, result: jax.Array) -> None:
        """Make a layer's plan if it waited for the device (`_plan_later`), then unpin its slots once `result`
        (computed from its expert outputs, dispatched) is ready."""
        if pending[4] is not None:
            pending[4](result)
        result.block_until_ready()
        self.cache.unpin(pending[3])
        return None

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: Optional[int] = None,
                 pad_token_id: Optional[int] = None, keep_logits: bool = False,
                 forced: Optional[np.ndarray] = None) -> OffloadOutput:
        """Greedy generation (the same tokens as the in-memory model, whatever the plans).

        `forced` int [B, max_new_tokens]: teacher forcing, column j is fed at decode step j + 1 whatever the
        model chose (its own choices still go to `tokens`); with `keep_logits`, the logits of every pass."""
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate: empty batch or empty prompt")
        longest = max(map(len, prompts))
        if longest + max_new_tokens > self.cfg.max_position_embeddings:
            raise ValueError(f"generate: {longest} prompt tokens + {max_new_tokens} new exceed max_position_embeddings="
                             f"{self.cfg.max_position_embeddings}")
        pad = pad_id(pad_token_id, eos_token_id)
        eos = -1 if eos_token_id is None else eos_token_id
        B, P, capacity = padded_shapes(prompts, max_new_tokens)
        tokens, valid = left_pad(prompts, P, pad)
        positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
        kv = init_cache(self.model, B, capacity, self.model.run_dtype)
        seqs = np.arange(B) + self.seq_offset
        self.accounting.new_run()  # this call's metrics and passes only
        out = np.full((B, max_new_tokens), pad, np.int32)
        all_logits = []
        t_start = time.perf_counter()
        self.accounting.recording = self.settings.timeline_passes > 0
        with self.timer.window():  # each pass is one window of Timer samples (dropped if it compiled)
            if self._can_fuse():  # nothing to plan: the prefill as one device call
                logits, kv = self._fused_forward(kv, tokens, positions, valid, Phase.prefill)
            else:
                logits, kv = self._forward(kv, tokens, positions, valid, Phase.prefill, seqs, longest)
            host = np.asarray(logits)
        first_logits = host
        prefill_pass = self.accounting.pass_index
        prefill_s = time.perf_counter() - t_start
        self.accounting.metrics.add_pass(True, prefill_s)
        nxt = host.argmax(-1).astype(np.int32)
        out[:, 0] = nxt
        done = nxt == eos
        if forced is not None:
            nxt = np.asarray(forced[:, 0], np.int32)
        next_pos = positions[:, -1] + 1
        steps: list[float] = []
        for step in range(1, max_new_tokens):
            if done.all():
                break
            if keep_logits:
                all_logits.append(host)
            self.accounting.recording = step <= self.settings.timeline_passes
            if self._can_fuse() and forced is None:  # the rest of the decode has nothing to plan: one device loop
                tokens_run, seconds, logits_run = self._fused_decode(kv, nxt, next_pos, done, max_new_tokens - step,
                                                                     eos, pad, keep_logits)
                out[:, step:step + len(seconds)] = tokens_run
                steps += seconds
                for s in seconds:
                    self.accounting.metrics.add_pass(False, s)
                if logits_run is not None:
                    all_logits += list(logits_run[:-1])
                    host = logits_run[-1]
                break
            with self.timer.window():
                t = time.perf_counter()
                step_args = (kv, nxt[:, None], next_pos[:, None].astype(np.int32), np.ones((B, 1), bool), Phase.decode)
                fused = self._can_fuse()  # (only under teacher forcing: one device call per pass)
                if fused:
                    logits, kv = self._fused_forward(*step_args)
                else:
                    logits, kv = self._forward(*step_args, seqs, int(next_pos.mean()))
                host = np.asarray(logits)
                steps.append(time.perf_counter() - t)
                if not fused:
                    outside = self._modelled_outside_moe(B, int(next_pos.mean()))
                    self.timer.pass_overhead(steps[-1] - self._moe_wall - outside)
            self.accounting.metrics.add_pass(False, steps[-1])
            nxt = np.where(done, pad, host.argmax(-1)).astype(np.int32)
            out[:, step] = nxt
            done |= nxt == eos
            if forced is not None:
                nxt = np.asarray(forced[:, step], np.int32)
            next_pos = next_pos + 1
        self.accounting.recording = False
        if keep_logits:
            all_logits.append(host)
        total = time.perf_counter() - t_start
        self.accounting.metrics.finish(total, self.book.measured_hit_rates())
        hit = out == eos
        lengths = np.where(hit.any(1), hit.argmax(1) + 1, max_new_tokens)
        return OffloadOutput(tokens=out, lengths=lengths, prefill_s=prefill_s, decode_s=sum(steps), step_s=steps,
                             metrics=self.accounting.metrics, events=list(self.accounting.events),
                             prefill_pass=prefill_pass, last_logits=first_logits, all_logits=all_logits)
