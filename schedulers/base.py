"""The offload scheduler contract: a layer's state in, a concrete plan out.

Policy only (DESIGN.md): plain Python / numpy, no device, no I/O. The discrete-event simulator
(`engine/sim/`) and the real offload executor fill a `LayerState` from their expert cache and
transfer queue after each MoE layer's gate, call `scheduler.plan(state)`, and carry the returned
`LayerPlan` out. Layers are MoE-layer indices (0 = first MoE layer); experts are ids in [0, E).

Transfer semantics every mechanism implements (LayerScope Premises 3 and 4):
- one serial host->device link; a started transfer is never interrupted (`LayerState.inflight`);
- transfers issued by earlier plans that have not started yet (`LayerState.queued`) are dropped
  when a new plan arrives unless the plan lists them again or holds them (`plan.hold`: a baseline
  whose issued copies cannot be cancelled, they keep the head of the link); the new queue is
  `plan.hold`, then `plan.ondemand` (in order), then `plan.prefetch` (in order);
- an on-demand load goes to a staging buffer (freed after its GPU compute) unless `retain` puts it
  in the expert cache; a prefetch always lands in the cache. A cache slot is taken when a transfer
  is issued, so `len(retained loads) + len(prefetch) + len(hold) <= free_slots + len(evict)`;
- evictions are applied first and may not touch experts the current layer computes on the GPU
  or transfers in flight.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import numpy as np

from schedulers.cost import CostModel
from schedulers.registry import Registry


class Phase(enum.Enum):
    prefill = "prefill"
    decode = "decode"


class Eviction(enum.Enum):
    """Which expert of a pinned + dynamic cache's replaceable slots makes room first."""

    lru = "lru"  # least recently used
    token_share = "token_share"  # lowest moving average of the share of its layer's tokens routed to it (ties: LRU)


@dataclass(frozen=True)
class SchedulerSettings:
    """What every offload scheduler's settings hold (the `scheduler` config group): the knobs the mechanism and
    the shared cache of `schedulers.policy.OffloadPolicy` read. Each policy's module extends it with its own
    knobs in a frozen dataclass whose `kind` defaults to the policy's registered name (`OFFLOAD.register`)."""

    kind: str = ""  # the registered policy (`scheduler=<kind>`: conf/scheduler/<kind>.yaml); "" for none
    label: str = ""  # name in tables and figures
    hot_table: bool = True  # preload the hottest experts from profiling runs (LayerScope §4.1 Counter)
    use_predictor: bool = True  # False: no forecasts (LayerScope ablation "no LLaPor")
    staging_slots: int = 2  # on-demand double buffer (LayerScope §4.4), taken from the memory budget
    dynamic_slots: Optional[int] = None  # cache slots outside the hot table; None: one layer's worth of experts
    # the pinned + dynamic cache every policy's base class keeps (schedulers/policy.py); presched.yaml sets LayerScope's
    # extension: retain_loads true, pin_hot_table false, eviction token_share
    retain_loads: bool = False  # keep on-demand loads in the cache (evicting per `eviction`), not staging only
    pin_hot_table: bool = True  # False: the hot table only starts the cache; any slot may be replaced
    eviction: Eviction = Eviction.lru  # replacement order of the replaceable slots
    usage_ema: float = 0.5  # `token_share`: U = a * share + (1 - a) * U per pass of the layer

    @property
    def forecast_window(self) -> int:
        """The furthest layer distance the policy reads forecasts at (the predictors a mechanism builds)."""
        return 1

    @property
    def in_flight(self) -> int:
        """Batches of `batch_size` sequences that go through the layers together (Klotski's pipeline: 2)."""
        return 1


@dataclass(frozen=True)
class Transfer:
    """One expert transfer known to the mechanism."""

    layer: int
    expert: int
    remaining_s: float = 0.0  # started transfers: time until it lands
    retain: bool = True  # lands in the cache (False: staging buffer)


@dataclass
class LayerState:
    """What a scheduler sees at MoE layer `layer`, right after its gate."""

    layer: int
    num_layers: int
    phase: Phase
    tokens: np.ndarray  # int64 [E]: tokens routed to each expert of this layer (0 = inactive)
    scores: np.ndarray  # float64 [E]: sum of routing weights per expert of this layer
    # target layer (> layer) -> float64 [E] predicted tokens per expert; lazy: `in` is free, reading a target
    # runs its predictor, so a scheduler reads only the targets its plan needs
    predicted: Mapping[int, np.ndarray]
    resident: np.ndarray  # bool [L, E]: weights on the GPU (landed)
    inflight: tuple[Transfer, ...]  # started, not interruptible
    queued: tuple[Transfer, ...]  # issued by earlier plans, not started: dropped unless listed again
    alpha_s: float  # time until the link is free of started transfers (eq. 3 alpha)
    cache_slots: int  # expert-cache capacity in experts
    free_slots: int  # cache slots neither resident nor reserved by started transfers
    batch_tokens: int  # tokens in this forward pass
    context_len: int  # mean KV length of the sequences
    hit_rate: dict[int, float]  # distance -> predictor's measured hit rate (eq. 6 R_hit)
    cost: CostModel
    t_io_s: float  # one expert transfer as the mechanism runs it now (synchronous copies are slower)
    t_attn_next_s: float  # the next layer's attention block (eq. 3 / eq. 5 t_attn)
    tokens_by_microbatch: Optional[np.ndarray] = None  # int64 [M, E] when the mechanism splits the batch

    @property
    def num_experts(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def active(self) -> np.ndarray:
        """int [n]: experts with tokens at this layer."""
        return np.flatnonzero(self.tokens)

    def inflight_experts(self, layer: int) -> set[int]:
        return {t.expert for t in self.inflight if t.layer == layer}

    def available(self, layer: int) -> np.ndarray:
        """bool [E]: resident or landing (started transfer) at `layer` (do not modify the result)."""
        cache = self.__dict__.setdefault("_available", {})
        if layer not in cache:
            avail = self.resident[layer]
            landing = [t.expert for t in self.inflight if t.layer == layer]
            if landing:
                avail = avail.copy()
                avail[landing] = True
            cache[layer] = avail
        return cache[layer]


@dataclass(frozen=True)
class LayerPlan:
    """A scheduler's decision for one layer, concrete enough for the real executor."""

    cpu: tuple[int, ...] = ()  # experts of this layer computed on the CPU, in order
    gpu: tuple[int, ...] = ()  # experts of this layer computed on the GPU (resident, landing or loaded now)
    ondemand: tuple[int, ...] = ()  # experts of this layer loaded now, in link order (subset of gpu)
    retain: tuple[bool, ...] = ()  # per on-demand load: keep it cached after use (else staging)
    prefetch: tuple[tuple[int, int], ...] = ()  # (target, expert) in link order after on-demand (< layer: next pass)
    evict: tuple[tuple[int, int], ...] = ()  # (layer, expert) dropped from the cache before any transfer
    # (layer, expert) prefetches of `state.queued` kept, not dropped: they stay at the head of the link, ahead of the
    # on-demand loads; one of this layer that the plan computes on the GPU is waited for like a landing prefetch
    hold: tuple[tuple[int, int], ...] = ()
    # Expert Deferral (kTransformers, SOSP'25): per token, up to this many of its lowest-weight routed experts that run
    # on the CPU (never its highest-weight one) land one MoE layer late, added to the residual with the next MoE layer's
    # output, so the CPU computes them while the GPU runs on. It changes the model's output: 0 in every exact policy
    defer: int = 0
    # Speculative expert execution (arXiv 2603.19289): the experts of this layer, most likely first, the layer computes
    # in place of the router's choice (`engine.offload.speculation`: a routed pair whose expert is not here is computed
    # by one that is). `cpu` + `gpu` then list exactly these. It changes the model's output: None in every exact policy
    speculate: Optional[tuple[int, ...]] = None

    def held_here(self, layer: int) -> set[int]:
        """Experts of `layer` whose held prefetch brings them."""
        return {e for target, e in self.hold if target == layer}

    def __post_init__(self) -> None:
        if not self.retain and self.ondemand:
            object.__setattr__(self, "retain", (False,) * len(self.ondemand))
        if len(self.retain) != len(self.ondemand):
            raise ValueError(f"LayerPlan: {len(self.retain)} retain flags for {len(self.ondemand)} on-demand loads")

    def validate(self, state: LayerState) -> None:
        """Raise ValueError when the plan breaks the contract of the module docstring."""
        active = set(state.active.tolist())
        cpu, gpu = set(self.cpu), set(self.gpu)
        where = f"layer {state.layer}"
        if len(cpu) != len(self.cpu) or len(gpu) != len(self.gpu):
            raise ValueError(f"{where}: an expert is listed twice in cpu or gpu")
        if cpu & gpu:
            raise ValueError(f"{where}: experts {sorted(cpu & gpu)} on both CPU and GPU")
        want = active if self.speculate is None else set(self.speculate)
        if self.speculate is not None and (len(want) != len(self.speculate) or not want):
            raise ValueError(f"{where}: speculate={self.speculate} must list distinct experts, at least one")
        if cpu | gpu != want:
            raise ValueError(f"{where}: plan covers {sorted(cpu | gpu)} but "
                             + (f"active experts are {sorted(active)}" if self.speculate is None
                                else f"it speculates {sorted(want)}"))
        avail = state.available(state.layer)
        loads = set(self.ondemand)
        if len(loads) != len(self.ondemand) or not loads <= gpu:
            raise ValueError(f"{where}: on-demand loads {self.ondemand} must be distinct GPU experts")
        if any(avail[e] for e in loads):
            raise ValueError(f"{where}: on-demand load of an expert already resident or landing")
        self._validate_hold(state, loads)
        if self.defer and self.speculate is not None:
            raise ValueError(f"{where}: a plan may not both defer and speculate")
        if self.defer < 0 or (self.defer and (state.layer == state.num_layers - 1 or not self.cpu)):
            raise ValueError(f"{where}: defer={self.defer} needs a CPU expert and a later MoE layer to land in")
        held = self.held_here(state.layer)
        missing = [e for e in gpu if not avail[e] and e not in loads and e not in held]
        if missing:
            raise ValueError(f"{where}: GPU experts {missing} are neither resident, landing nor loaded")
        seen: set[tuple[int, int]] = set()
        for target, e in self.prefetch:
            # a target at or before this layer is for the next pass (Horizon's `next_step_layers`), never this layer
            if not 0 <= target < state.num_layers or target == state.layer:
                raise ValueError(f"{where}: prefetch target layer {target} must lie in [0, {state.num_layers}) "
                                 f"and not be this layer")
            if (target, e) in seen or state.available(target)[e] or (target, e) in self.hold:
                raise ValueError(f"{where}: prefetch ({target}, {e}) duplicated or already resident/landing")
            seen.add((target, e))
        flying = {(t.layer, t.expert) for t in state.inflight}
        for layer, e in self.evict:
            if not state.resident[layer, e]:
                raise ValueError(f"{where}: evict ({layer}, {e}) is not resident")
            if (layer, e) in flying or (layer == state.layer and e in gpu):
                raise ValueError(f"{where}: evict ({layer}, {e}) is in use")
        need = sum(self.retain) + len(self.prefetch) + len(self.hold)
        if need > state.free_slots + len(self.evict):
            raise ValueError(f"{where}: {need} cache slots needed, {state.free_slots} free + {len(self.evict)} evicted")

    def _validate_hold(self, state: LayerState, loads: set[int]) -> None:
        """Held transfers are distinct transfers still queued (one whose layer has run lands for the next pass), none
        loaded again."""
        where = f"layer {state.layer}"
        queued = {(t.layer, t.expert) for t in state.queued}
        if len(set(self.hold)) != len(self.hold) or not set(self.hold) <= queued:
            raise ValueError(f"{where}: hold {self.hold} must be distinct transfers of state.queued")
        if loads & self.held_here(state.layer):
            raise ValueError(f"{where}: experts {sorted(loads & self.held_here(state.layer))} both held and loaded")


@runtime_checkable
class OffloadScheduler(Protocol):
    """What the simulator and the executor call. One object serves one model on one machine."""

    name: str
    settings: SchedulerSettings

    @property
    def micro_batches(self) -> int:
        """How many micro-batches the mechanism pipelines per layer (Klotski: 2, others 1)."""
        ...

    def initial_residency(self) -> np.ndarray:
        """bool [L, E]: experts loaded before serving starts (hot table), within the cache capacity."""
        ...

    @property
    def resident_on_device(self) -> bool:
        """True if every resident active expert of a layer is always planned on the device."""
        ...

    def plan(self, state: LayerState) -> LayerPlan:
        ...


@dataclass(frozen=True)
class PlanningPrice:
    """What the run that drives a policy charges for the policy's `plan` calls on the host's critical path, told to the
    policy when it is built (`SchedulerSetup.planning`), so that work a plan may leave out (Horizon's search) runs only
    where it saves more than the run charges for it. The default is free: nothing a plan does costs the run (the
    simulator with `simulate.planning` off, every study's setting so far). `clock`: the run charges each plan call this
    clock's time over it (the real executor: `time.perf_counter`, the wall time the layer waits; the simulator's
    `measured` / `measured_cpu`: `perf_counter` / `thread_time`), so the policy times its optional work with the same
    clock. `search_s`: seconds the run adds to a plan call that ran its optional search (the simulator's `fixed` mode,
    `planning.search_us.<kind>`); a policy reports such a call by `OffloadPolicy.searched`."""

    clock: Optional[Callable[[], float]] = None
    search_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.search_s >= 0:
            raise ValueError(f"PlanningPrice.search_s ({self.search_s}) must be >= 0 s")

    @property
    def free(self) -> bool:
        """Whether the run charges nothing for a plan's optional work."""
        return self.clock is None and self.search_s == 0


@dataclass(frozen=True)
class SchedulerSetup:
    """What a scheduler is built with: shapes, memory, costs and the profiling statistics."""

    num_layers: int
    num_experts: int
    top_k: int
    cache_slots: int  # experts the cache holds (staging excluded)
    cost: CostModel
    profile_loads: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # int64 [L, E] tokens per expert in profiling runs
    planning: PlanningPrice = field(default_factory=PlanningPrice)  # what the run charges for the policy's plans


OFFLOAD = Registry("schedulers.offload", what="offload policy", key="scheduler.kind", base=SchedulerSettings)
register = OFFLOAD.register  # class decorator of a policy module: `@register("name", settings=NameSettings)`


def scheduler_settings(node: Any) -> SchedulerSettings:
    """The settings of the policy a `scheduler` config node names (each key checked against that policy's)."""
    return OFFLOAD.settings_from(node, where="scheduler")


def build_scheduler(settings: SchedulerSettings, setup: SchedulerSetup) -> OffloadScheduler:
    """The scheduler that `settings.kind` names, built for `setup`."""
    return OFFLOAD.entry_for(settings).policy(settings, setup)
