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
dispatched (no hand-over to the worker: nothing on the link needs watching). The Timer feeds
measured costs back into the cost model.
Dense layers, attention, routers, shared experts and the LM head always run on the device.

With every routed expert resident and a scheduler that plans such layers as device work alone, a
pass has nothing to decide: it runs as one fused device call over the cache slots (`fuse_resident`),
and its routing still feeds the Counter, the residency metrics and the results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.offload.cache import DeviceExpertCache
from engine.offload.cpu_experts import CpuExperts
from engine.offload.forecasts import LiveForecastBook
from engine.offload.kernels import LayerKernels
from engine.offload.link import Job, TransferLink
from engine.offload.store import ExpertStore
from engine.offload.timer import Timer
from engine.sim.metrics import RunMetrics
from engine.sim.pipeline import Event
from engine.sim.predictions import LazyForecasts
from models.config import ModelConfig
from models.generation import bucket, left_pad, pad_id
from models.transformer import MoETransformer, init_cache
from predictors.base import LayerContext, Predictor
from schedulers.base import LayerPlan, LayerState, OffloadScheduler, Phase, Transfer
from schedulers.cost import CostModel


@dataclass(frozen=True)
class OffloadSettings:
    """Mechanism knobs (the `offload` config block)."""

    cache_slots: int  # expert-cache capacity in experts (staging buffers not included)
    staging_slots: int = 2  # on-demand double buffer
    chunks: int = 2  # row chunks per projection transfer (AsyncIO sub-transfers: 3 projections x chunks)
    async_io: bool = True  # False: synchronous copies (LayerScope ablation "no AsyncIO")
    cpu_threads: int = 1  # host threads of the CPU experts (see CpuExperts)
    retries: int = 2  # attempts after a failed transfer before it surfaces
    validate_plans: bool = True  # check every plan against the scheduler contract
    timeline_passes: int = 32  # record lane events of the prefill and the first N decode passes (timeline plots)
    # a pass with every routed expert resident, nothing on the link and a scheduler that would plan device
    # work only runs as one device call (no gate to stop at: there is nothing to decide); False: layer by layer
    fuse_resident: bool = True


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


def new_cache(cfg: ModelConfig, settings: OffloadSettings, dtype: Any) -> DeviceExpertCache:
    """The device expert cache `settings` ask for, in the model's dtype."""
    return DeviceExpertCache(cfg, settings.cache_slots, settings.staging_slots, dtype)


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
        dtype = model.embed[...].dtype
        self._owns_cache = cache is None
        self.cache = cache if cache is not None else new_cache(cfg, settings, dtype)
        self.cache.reset()
        if (self.cache.cache_slots, len(self.cache.slots) - self.cache.cache_slots) != (settings.cache_slots,
                                                                                       settings.staging_slots):
            raise ValueError(f"cache of {self.cache.cache_slots} + {len(self.cache.slots) - self.cache.cache_slots} "
                             f"slots given to an executor of {settings.cache_slots} + {settings.staging_slots}")
        self.timer = Timer(cost, store.expert_bytes)
        self.metrics = RunMetrics(num_layers=self.L)
        self.link = TransferLink(store, self.cache, settings.chunks, synchronous=not settings.async_io,
                                 retries=settings.retries, on_done=self._on_io_done, fault=fault)
        self.cpu = CpuExperts(store, settings.cpu_threads)
        self.kernels = LayerKernels(model)
        self.book = LiveForecastBook(predictors or {}, self.k, self.E)
        for predictor in (predictors or {}).values():  # online learning compiles now, not inside a decode step
            getattr(predictor, "warm_up", lambda: None)()
        self.row_lookup = row_lookup
        H, F = cfg.hidden_size, cfg.expert_intermediate_size
        # committed to the cache's device like the slots: an uncommitted filler would make every pattern of
        # (slot, filler) positions a new jit cache entry (a compile in the middle of serving)
        self._dummy = (jax.device_put(jnp.zeros((2 * F, H), dtype), self.cache.sharding),
                       jax.device_put(jnp.zeros((H, F), dtype), self.cache.sharding))
        self.events: list[Event] = []
        self._prefetched: dict[int, set[int]] = {}  # target MoE layer -> experts prefetched for it
        self.expert_tokens = np.zeros((self.L, self.E), np.int64)  # tokens routed per expert (the Counter)
        self.seq_offset = 0  # sequence id of the next batch's first row (row_lookup into a reference trace)
        self._t0 = time.perf_counter()
        self._pass = -1
        self._moe_wall = 0.0  # wall time of the current pass's MoE layers (the rest is the pass's overhead)
        self._record = False
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

    def close(self) -> None:
        """Stop the link and the CPU worker and give the device slots back (an executor built next, e.g.
        after the profiling run, must not find this one's cache still holding device memory)."""
        self.link.close()
        self.cpu.close()
        if self._owns_cache:
            self.cache.free()
        self._dummy = ()

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
        self.metrics.add_transfer(job.seconds, job.prefetch, self.store.expert_bytes)
        if self._record and job.started_at is not None:
            self.events.append(Event("link", job.started_at - self._t0, job.done_at - self._t0, self._pass,
                                     job.layer, job.expert, 0, "prefetch" if job.prefetch else "ondemand"))

    # ---- one MoE layer ---------------------------------------------------------------------------------
    def _state(self, m: int, phase: Phase, experts: np.ndarray, weights: np.ndarray, ctx: LayerContext,
               batch_tokens: int, context_len: int, rows: int, seq_len: int) -> LayerState:
        tokens = np.bincount(experts.reshape(-1), minlength=self.E).astype(np.int64)
        scores = np.bincount(experts.reshape(-1), weights=weights.reshape(-1), minlength=self.E)
        resident = self.cache.resident_mask()  # one snapshot: a transfer landing after it still counts as in flight
        inflight, alpha = link_view(self.link.active(), resident, self.cost.t_io, time.perf_counter())
        queued = tuple(Transfer(j.layer, j.expert, self.cost.t_io, j.retain) for j in self.link.queued())
        reserved_by_queue = sum(1 for j in self.link.queued() if j.slot >= 0 and not self.cache.slots[j.slot].staging)
        return LayerState(layer=m, num_layers=self.L, phase=phase, tokens=tokens, scores=scores,
                          predicted=LazyForecasts(self.book, m, self._pass, ctx.rows, self.L),
                          resident=resident, inflight=inflight, queued=queued, alpha_s=alpha,
                          cache_slots=self.cache.cache_slots,
                          free_slots=self.cache.free_cache_slots() + reserved_by_queue,
                          batch_tokens=batch_tokens, context_len=context_len, hit_rate=self.book.hit_rates(),
                          cost=self.cost, t_io_s=self.cost.t_io if self.settings.async_io else self.cost.t_io_sync,
                          t_attn_next_s=self.cost.t_attn(rows, context_len, prefill=phase is Phase.prefill,
                                                         prompt_len=seq_len))

    def _issue(self, m: int, plan: LayerPlan) -> None:
        """Evictions, then the new link queue: on-demand loads in order, then prefetches."""
        for layer, e in plan.evict:
            self.cache.evict(layer, e)
        self.link.submit([])  # drop unstarted transfers of earlier plans (their slots come back)
        jobs = []
        for e, retain in zip(plan.ondemand, plan.retain):
            slot = self.cache.reserve(m, e, staging=False) if retain else -1
            jobs.append(Job(m, e, slot, retain=retain, prefetch=False))
        for target, e in plan.prefetch:
            jobs.append(Job(target, e, self.cache.reserve(target, e, staging=False), retain=True, prefetch=True))
            self._prefetched.setdefault(target, set()).add(e)
        self.link.submit(jobs)

    def _device_experts(self, g: jax.Array, experts: np.ndarray, weights: np.ndarray, chosen: Sequence[int],
                        m: int) -> tuple[jax.Array, list[int]]:
        """Dispatch the device computation of experts `chosen` of MoE layer m (their slots pinned)."""
        slots = [self.cache.slot_of(m, e) for e in chosen]
        self.cache.pin(slots)  # type: ignore[arg-type]
        gate_up, down = self.cache.arrays()
        local = np.full(self.E, -1, np.int32)
        local[list(chosen)] = np.arange(len(chosen), dtype=np.int32)
        idx = np.where(experts >= 0, local[np.maximum(experts, 0)], -1)
        gu = [gate_up[s] for s in slots] + [self._dummy[0]] * (self.E - len(slots))  # type: ignore[index]
        dn = [down[s] for s in slots] + [self._dummy[1]] * (self.E - len(slots))  # type: ignore[index]
        return self.kernels.experts(g, idx, weights, gu, dn), slots  # type: ignore[return-value]

    def _moe_layer(self, layer: int, g: jax.Array, experts_d: jax.Array, weights_d: jax.Array, phase: Phase,
                   valid_flat: np.ndarray, seqs: np.ndarray, pos: np.ndarray, tokens: np.ndarray, context_len: int,
                   begin: float) -> tuple[list[jax.Array], list[int]]:
        """Plan MoE layer `layer` (its gate has run) and compute its experts: (partial outputs, pinned slots).

        `begin`: when the layer's attention call was dispatched; the wall time from there to the issued
        plan, minus the modelled attention, is the layer's fixed host overhead (the Timer's sample)."""
        m = self.moe_index[layer]
        start = time.perf_counter()
        experts = np.asarray(experts_d).astype(np.int64)  # the sync point of the layer
        weights = np.asarray(weights_d).astype(np.float32)
        experts = np.where(valid_flat[:, None], experts, -1)  # padding rows route nowhere
        live = valid_flat
        self.book.settle_live(m, experts[live])
        np.add.at(self.expert_tokens[m], experts[live].reshape(-1), 1)
        g_host = np.asarray(g).reshape(-1, self.cfg.hidden_size)
        ctx = LayerContext(layer=m, step=self._pass, experts=experts[live], weights=weights[live],
                           hidden=g_host[live].astype(np.float32), tokens=tokens[live], seq=seqs[live], pos=pos[live],
                           rows=self.row_lookup(seqs[live], pos[live]) if self.row_lookup is not None else None)
        self.book.begin_layer(ctx)
        B, S = g.shape[:2]
        parts: list[jax.Array] = []
        pinned: list[int] = []
        early: list[int] = []
        gpu_start = time.perf_counter()
        if self.scheduler.resident_on_device:  # the plan will keep these on the device: start them now
            early = [int(e) for e in np.unique(experts[live]) if e >= 0 and self.cache.is_resident(m, int(e))]
            if early:
                y, slots = self._device_experts(g, experts, weights, early, m)
                parts.append(y)
                pinned += slots
        with self.link.hold():  # the plan point: the link's queue stays as the scheduler sees it
            state = self._state(m, phase, experts[live], weights[live], ctx, int(live.sum()), context_len, B, S)
            plan = self.scheduler.plan(state)
            if self.settings.validate_plans:
                plan.validate(state)
            if not set(early) <= set(plan.gpu):
                raise RuntimeError(f"{self.scheduler.name}: resident_on_device, but the plan of MoE layer {m} moves "
                                   f"resident experts {sorted(set(early) - set(plan.gpu))} off the device")
            self._issue(m, plan)
        if phase is Phase.decode:  # prefill's attention is far from its model; decode is what the overhead serves
            self.timer.layer_overhead(time.perf_counter() - begin - state.t_attn_next_s)
        available = state.available(m)
        self.metrics.add_residency(phase is Phase.prefill, len(state.active), int(available[state.active].sum()))
        prefetched = self._prefetched.pop(m, set())
        self.metrics.add_prefetch_outcome(len(prefetched & set(state.active.tolist())), len(prefetched))

        # CPU side: the torch worker starts now, unless no on-demand load is to be waited for: then the main
        # thread computes it itself once the device work is dispatched (a hand-over costs ~0.2 ms here)
        inline_cpu = bool(plan.cpu) and not plan.ondemand
        cpu_future = self.cpu.submit(m, g_host, experts, weights, list(plan.cpu)) if plan.cpu and not inline_cpu \
            else None
        cpu_started = time.perf_counter()
        skip = set(plan.ondemand) | set(early)
        ready = [e for e in plan.gpu if e not in skip]
        for e in ready:  # landing prefetches of this layer are waited for; resident ones are there
            if not self.cache.is_resident(m, e):
                self.link.wait(m, e)
        if not early:
            gpu_start = time.perf_counter()
        if ready:
            y, slots = self._device_experts(g, experts, weights, ready, m)
            parts.append(y)
            pinned += slots
        for e, retain in zip(plan.ondemand, plan.retain):
            self.link.wait(m, e)  # OnIoDone for this expert
            # a sample times the call alone: device calls run in order (earlier queued work would count), and
            # where the device is the host the CPU experts' worker shares its cores. Only decode calls are
            # samples: the cost model takes them as per-call dispatch, and a prefill call runs the grouped
            # kernel over every row of the pass (~2 ms against ~0.1 for a decode call of mixtral-tiny here)
            timed = phase is Phase.decode and all(p.is_ready() for p in parts) and \
                (cpu_future is None or cpu_future.done())
            t = time.perf_counter()
            y, slots = self._device_experts(g, experts, weights, [e], m)
            parts.append(y)
            if retain:
                pinned += slots
            else:  # the staging buffer goes back to the link once its compute is done
                y.block_until_ready()
                if timed:
                    self.timer.gpu(int((experts == e).sum()), time.perf_counter() - t)
                self.cache.unpin(slots)
                self.cache.release(slots[0])
        cpu_out, cpu_busy = None, 0.0
        if inline_cpu:
            cpu_started = time.perf_counter()
            cpu_out = self.cpu.compute(m, g_host, experts, weights, list(plan.cpu))
            cpu_busy = time.perf_counter() - cpu_started
        gpu_busy = 0.0
        if parts:  # (after an inline CPU side, the device side is seen done no earlier than the CPU side)
            jax.block_until_ready(parts)
            gpu_busy = time.perf_counter() - gpu_start
        if cpu_future is not None:
            cpu_out = cpu_future.result()  # OnCpuGpuDone: both sides of the layer are done
            cpu_busy = time.perf_counter() - cpu_started
        if cpu_out is not None:
            parts.append(jnp.asarray(cpu_out))
            for tokens_n, seconds in self.cpu.timings:
                self.timer.cpu(tokens_n, seconds)
            if cpu_busy > gpu_busy:  # the CPU side was the critical path: what it took beyond its compute
                self.timer.cpu_dispatch(cpu_busy - sum(s for _, s in self.cpu.timings))  # is the hand-over
            self.cpu.timings.clear()
        if not parts:
            parts.append(jnp.zeros((g_host.shape[0], self.cfg.hidden_size), jnp.float32))
        while len(parts) > 1:  # one partial output: the fused residual call keeps one compiled signature
            parts[:2] = [parts[0] + parts[1]]  # (its pytree would otherwise change with the plan's call count)
        self.link.flush()  # no AsyncIO: prefetches finish inside the layer that issued them
        seconds = time.perf_counter() - start
        self._account(phase, m, plan, seconds, gpu_busy, cpu_busy, start, gpu_start, cpu_started)
        return parts, pinned

    def _account(self, phase: Phase, m: int, plan: LayerPlan, seconds: float, gpu_busy: float, cpu_busy: float,
                 start: float, gpu_start: float, cpu_start: float) -> None:
        self.metrics.add_layer(phase is Phase.prefill, m, seconds, gpu_busy, cpu_busy, n_cpu=len(plan.cpu),
                               n_gpu=len(plan.gpu), n_ondemand=len(plan.ondemand), n_prefetch=len(plan.prefetch))
        if self._record:
            t = self._t0
            if gpu_busy:
                self.events.append(Event("gpu", gpu_start - t, gpu_start - t + gpu_busy, self._pass, m, -1, 0, "expert"))
            if cpu_busy:
                self.events.append(Event("cpu", cpu_start - t, cpu_start - t + cpu_busy, self._pass, m, -1, 0, "expert"))

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

    def _account_fused(self, prefill: bool, experts: np.ndarray) -> None:
        """Counter and residency metrics of fused passes: experts [passes, L, tokens, k] (all resident)."""
        P = experts.shape[0]
        for m in range(self.L):
            np.add.at(self.expert_tokens[m], experts[:, m].reshape(-1), 1)
        used = np.zeros((P, self.L, self.E), bool)
        used[np.arange(P)[:, None, None, None], np.arange(self.L)[None, :, None, None], experts] = True
        active = int(used.sum())
        self.metrics.add_residency(prefill, active, active)
        self.metrics.add_fused_passes(prefill, P)

    def _fused_forward(self, kv: Any, tokens: np.ndarray, positions: np.ndarray, valid: np.ndarray,
                       phase: Phase) -> tuple[jax.Array, Any]:
        """A pass over a full cache as one device call; its routing is accounted afterwards."""
        self._pass += 1
        t = time.perf_counter()
        logits, kv, routed = self.kernels.resident_pass(*self._resident_slots(), kv, tokens, positions, valid)
        self._account_fused(phase is Phase.prefill, np.asarray(routed)[None, :, valid.reshape(-1)])
        if self._record:
            self.events.append(Event("gpu", t - self._t0, self._now(), self._pass, -1, -1, int(valid.sum()), "fused"))
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
        self._account_fused(False, np.asarray(routed)[:n])
        if self._record:
            self.events.append(Event("gpu", t - self._t0, self._now(), self._pass + 1, -1, -1, len(tokens) * n,
                                     "fused decode"))
        self._pass += n
        return out, [seconds / n] * n, None if logits is None else np.asarray(logits)[:n]

    def _forward(self, kv: Any, tokens: np.ndarray, positions: np.ndarray, valid: np.ndarray, phase: Phase,
                 seqs: np.ndarray, context_len: int) -> tuple[jax.Array, Any]:
        """One forward pass; a MoE layer's residual is finished in the same call as the next layer's gate."""
        self._pass += 1
        self._moe_wall = 0.0
        B, S = tokens.shape
        ai, kv = self.kernels.prepare(kv, jnp.asarray(positions), jnp.asarray(valid))
        x = self.kernels.embed_tokens(jnp.asarray(tokens))
        flat = (valid.reshape(-1), np.repeat(seqs, S), positions.reshape(-1), tokens.reshape(-1))
        layers = list(kv.layers)
        pending: Optional[tuple[int, jax.Array, list, list]] = None  # MoE layer awaiting its residual
        for i, layer in enumerate(self.model.layers):
            t = time.perf_counter()
            if not layer.is_moe:
                if pending is not None:
                    x = self.kernels.back(pending[0], x, pending[1], pending[2])
                    pending = self._release(pending, x)
                x, layers[i] = self.kernels.dense(i, x, ai, layers[i])
                continue
            if pending is None:
                x, layers[i], g, experts, weights = self.kernels.front(i, x, ai, layers[i])
            else:
                x, layers[i], g, experts, weights = self.kernels.back_front(pending[0], x, pending[1], pending[2], i,
                                                                            ai, layers[i])
                pending = self._release(pending, experts)
            if self._record:
                experts.block_until_ready()
                self.events.append(Event("gpu", t - self._t0, self._now(), self._pass, self.moe_index[i], -1, 0, "attn"))
            parts, pinned = self._moe_layer(i, g, experts, weights, phase, *flat, context_len, t)
            self._moe_wall += time.perf_counter() - t
            pending = (i, g, parts, pinned)
        if pending is not None:
            x = self.kernels.back(pending[0], x, pending[1], pending[2])
            self._release(pending, x)
        self.book.drop_pending()
        kv = type(kv)(layers=layers, valid=kv.valid, positions=kv.positions, index=kv.index + S)
        return self.kernels.logits(x[:, -1]), kv

    def _modelled_outside_moe(self, rows: int, context_len: int) -> float:
        """What the cost model charges a decode pass outside its MoE layers: dense layers and the head."""
        n_dense = self.cfg.num_hidden_layers - self.L
        dense = n_dense * (self.cost.t_attn(rows, context_len) + self.cost.t_dense_mlp(rows)) if n_dense else 0.0
        return dense + self.cost.t_head(rows)

    def _release(self, pending: tuple, result: jax.Array) -> None:
        """Unpin a finished layer's slots once `result` (computed from its expert outputs) is ready."""
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
        kv = init_cache(self.model, B, capacity, self.model.embed[...].dtype)
        seqs = np.arange(B) + self.seq_offset
        self.metrics = RunMetrics(num_layers=self.L)
        self.events = []  # this call's passes only
        out = np.full((B, max_new_tokens), pad, np.int32)
        all_logits = []
        t_start = time.perf_counter()
        self._record = self.settings.timeline_passes > 0
        with self.timer.window():  # each pass is one window of Timer samples (dropped if it compiled)
            if self._can_fuse():  # nothing to plan: the prefill as one device call
                logits, kv = self._fused_forward(kv, tokens, positions, valid, Phase.prefill)
            else:
                logits, kv = self._forward(kv, tokens, positions, valid, Phase.prefill, seqs, longest)
            host = np.asarray(logits)
        first_logits = host
        prefill_pass = self._pass
        prefill_s = time.perf_counter() - t_start
        self.metrics.add_pass(True, prefill_s)
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
            self._record = step <= self.settings.timeline_passes
            if self._can_fuse() and forced is None:  # the rest of the decode has nothing to plan: one device loop
                tokens_run, seconds, logits_run = self._fused_decode(kv, nxt, next_pos, done, max_new_tokens - step,
                                                                     eos, pad, keep_logits)
                out[:, step:step + len(seconds)] = tokens_run
                steps += seconds
                for s in seconds:
                    self.metrics.add_pass(False, s)
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
            self.metrics.add_pass(False, steps[-1])
            nxt = np.where(done, pad, host.argmax(-1)).astype(np.int32)
            out[:, step] = nxt
            done |= nxt == eos
            if forced is not None:
                nxt = np.asarray(forced[:, step], np.int32)
            next_pos = next_pos + 1
        self._record = False
        if keep_logits:
            all_logits.append(host)
        total = time.perf_counter() - t_start
        self.metrics.finish(total, self.book.measured_hit_rates())
        hit = out == eos
        lengths = np.where(hit.any(1), hit.argmax(1) + 1, max_new_tokens)
        return OffloadOutput(tokens=out, lengths=lengths, prefill_s=prefill_s, decode_s=sum(steps), step_s=steps,
                             metrics=self.metrics, events=list(self.events), prefill_pass=prefill_pass,
                             last_logits=first_logits,
                             all_logits=all_logits)
