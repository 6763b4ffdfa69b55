"""The offload scheduler contract: a layer's state in, a concrete plan out.

Policy only (DESIGN.md): plain Python / numpy, no device, no I/O. The discrete-event simulator
(`engine/sim/`) and the real offload executor fill a `LayerState` from their expert cache and
transfer queue after each MoE layer's gate, call `scheduler.plan(state)`, and carry the returned
`LayerPlan` out. Layers are MoE-layer indices (0 = first MoE layer); experts are ids in [0, E).

Transfer semantics every mechanism implements (LayerScope Premises 3 and 4):
- one serial host->device link; a started transfer is never interrupted (`LayerState.inflight`);
- transfers issued by earlier plans that have not started yet (`LayerState.queued`) are dropped
  when a new plan arrives unless the plan lists them again; the new queue is `plan.ondemand`
  (in order) followed by `plan.prefetch` (in order);
- an on-demand load goes to a staging buffer (freed after its GPU compute) unless `retain` puts it
  in the expert cache; a prefetch always lands in the cache. A cache slot is taken when a transfer
  is issued, so `len(retained loads) + len(prefetch) <= free_slots + len(evict)`;
- evictions are applied first and may not touch experts the current layer computes on the GPU
  or transfers in flight.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, runtime_checkable

import numpy as np

from schedulers.cost import CostModel


class Phase(enum.Enum):
    prefill = "prefill"
    decode = "decode"


class SchedulerKind(enum.Enum):
    presched = "presched"  # LayerScope PreSched (Algorithm 1)
    layerwise = "layerwise"  # LayerScope ablation "no PreSched": greedy per-layer split + fixed prefetch count
    hybrimoe = "hybrimoe"
    fiddler = "fiddler"
    klotski = "klotski"
    fate = "fate"
    ktransformers = "ktransformers"
    ondemand = "ondemand"  # Lina / ExpertFlow style: GPU only, load every miss, no prefetch
    lru = "lru"  # mixtral-offloading: per-layer LRU cache, no prefetch


class Eviction(enum.Enum):
    """Which expert of a pinned + dynamic cache's replaceable slots makes room first."""

    lru = "lru"  # least recently used
    token_share = "token_share"  # lowest moving average of the share of its layer's tokens routed to it (ties: LRU)


@dataclass(frozen=True)
class SchedulerSettings:
    """Every knob of every offload scheduler (the `scheduler` config group); each reads its own."""

    kind: SchedulerKind = SchedulerKind.presched
    label: str = "LayerScope"  # name in tables and figures
    hot_table: bool = True  # preload the hottest experts from profiling runs (LayerScope §4.1 Counter)
    use_predictor: bool = True  # False: no forecasts (LayerScope ablation "no LLaPor")
    prefetch_count: int = 2  # fixed prefetches per layer (hybrimoe, klotski, layerwise)
    max_window: int = 3  # presched Q4: furthest layer distance the prefetch window may extend to
    staging_slots: int = 2  # on-demand double buffer (LayerScope §4.4), taken from the memory budget
    dynamic_slots: Optional[int] = None  # cache slots outside the hot table; None: one layer's worth of experts
    score_ema: float = 0.5  # hybrimoe: S = a * score + (1 - a) * S (KScoreAwareCache alpha)
    micro_batches: int = 2  # klotski: micro-batches pipelined per layer
    prefill_gpu_min_tokens: int = 1024  # ktransformers: prefill passes of at least this many tokens run experts on the GPU
    round_half_up: bool = True  # presched eq. 5: |f| = round(f) with halves rounded up (else banker's rounding)
    retain_loads: bool = False  # presched: keep on-demand loads in the cache (evicting per `eviction`), not staging only
    pin_hot_table: bool = True  # False: the hot table only starts the cache; any slot may be replaced (presched)
    eviction: Eviction = Eviction.lru  # presched: replacement order of the replaceable slots
    usage_ema: float = 0.5  # presched `token_share`: U = a * share + (1 - a) * U per pass of the layer
    mask_gpu_compute: bool = True  # presched Premise 5 as written; False: T_G and T_gap count the GPU's work on resident experts
    offload_resident: bool = False  # presched extension: in decode, move the coldest resident experts to the idle CPU
    #   while that shortens the layer (max(T_C, T_G)); Algorithm 1 as written keeps every resident expert on the GPU


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
    prefetch: tuple[tuple[int, int], ...] = ()  # (target layer > layer, expert) in link order, after on-demand
    evict: tuple[tuple[int, int], ...] = ()  # (layer, expert) dropped from the cache before any transfer

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
        if cpu | gpu != active:
            raise ValueError(f"{where}: plan covers {sorted(cpu | gpu)} but active experts are {sorted(active)}")
        avail = state.available(state.layer)
        loads = set(self.ondemand)
        if len(loads) != len(self.ondemand) or not loads <= gpu:
            raise ValueError(f"{where}: on-demand loads {self.ondemand} must be distinct GPU experts")
        if any(avail[e] for e in loads):
            raise ValueError(f"{where}: on-demand load of an expert already resident or landing")
        missing = [e for e in gpu if not avail[e] and e not in loads]
        if missing:
            raise ValueError(f"{where}: GPU experts {missing} are neither resident, landing nor loaded")
        seen: set[tuple[int, int]] = set()
        for target, e in self.prefetch:
            if not state.layer < target < state.num_layers:
                raise ValueError(f"{where}: prefetch target layer {target} must lie in ({state.layer}, {state.num_layers})")
            if (target, e) in seen or state.available(target)[e]:
                raise ValueError(f"{where}: prefetch ({target}, {e}) duplicated or already resident/landing")
            seen.add((target, e))
        flying = {(t.layer, t.expert) for t in state.inflight}
        for layer, e in self.evict:
            if not state.resident[layer, e]:
                raise ValueError(f"{where}: evict ({layer}, {e}) is not resident")
            if (layer, e) in flying or (layer == state.layer and e in gpu):
                raise ValueError(f"{where}: evict ({layer}, {e}) is in use")
        need = sum(self.retain) + len(self.prefetch)
        if need > state.free_slots + len(self.evict):
            raise ValueError(f"{where}: {need} cache slots needed, {state.free_slots} free + {len(self.evict)} evicted")


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
class SchedulerSetup:
    """What a scheduler is built with: shapes, memory, costs and the profiling statistics."""

    num_layers: int
    num_experts: int
    top_k: int
    cache_slots: int  # experts the cache holds (staging excluded)
    cost: CostModel
    profile_loads: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # int64 [L, E] tokens per expert in profiling runs


_REGISTRY: dict[SchedulerKind, Callable[[SchedulerSettings, SchedulerSetup], OffloadScheduler]] = {}


def register(kind: SchedulerKind) -> Callable[[type], type]:
    """Class decorator: make `build_scheduler` construct `cls(settings, setup)` for `kind`."""

    def deco(cls: type) -> type:
        _REGISTRY[kind] = cls
        return cls

    return deco


_POLICY_MODULES = ("presched", "layerwise", "hybrimoe", "fiddler", "klotski", "fate", "ktransformers", "ondemand", "lru")


def _load_policies() -> None:
    import importlib

    for module in _POLICY_MODULES:  # each registers itself on import
        importlib.import_module(f"schedulers.{module}")


def build_scheduler(settings: SchedulerSettings, setup: SchedulerSetup) -> OffloadScheduler:
    """The scheduler that `settings.kind` names, built for `setup`."""
    _load_policies()

    try:
        cls = _REGISTRY[settings.kind]
    except KeyError:
        raise ValueError(f"scheduler.kind: {settings.kind} has no registered policy; known {sorted(k.name for k in _REGISTRY)}") from None
    return cls(settings, setup)


def registered_kinds() -> list[SchedulerKind]:
    _load_policies()

    return sorted(_REGISTRY, key=lambda k: k.value)
