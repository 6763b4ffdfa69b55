"""What every offload policy shares: the hot-table start, LRU stamps, eviction choice, plan assembly.

Cache organisations used by the policies:
- *pinned + dynamic* (LayerScope, Fiddler, Klotski, Fate, kTransformers, on-demand): the hot table
  (§4.1: preload the hottest until the budget is full) pins all cache slots but `dynamic_slots` and
  starts the dynamic region with the next hottest; pinned experts stay; the dynamic region holds
  prefetched or cached loads and evicts least-recently-used first (PreSched: per `eviction`, and
  with `pin_hot_table` off nothing is pinned). (An empty dynamic region would
  be memory the budget pays for and leaves unused until enough loads arrive, at small budgets or
  when little is prefetched the whole run.)
- *per-layer slots* (HybriMoE, mixtral-offloading): each layer owns an equal share of the slots,
  initialised with its hottest experts; evictions stay inside the layer (`layer_victims`).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import numpy as np

from schedulers.base import Eviction, LayerPlan, LayerState, SchedulerSettings, SchedulerSetup
from schedulers.hot_table import hot_table, per_layer_hot_table, per_layer_slots


class OffloadPolicy:
    """Base class of the offload schedulers (see `schedulers.base.OffloadScheduler`)."""

    per_layer_cache = False  # True: per-layer slots (HybriMoE, LRU) instead of pinned + dynamic
    # whether the last `plan` call ran optional work the run prices apart (`PlanningPrice.search_s`: Horizon's search)
    searched = False

    def __init__(self, settings: SchedulerSettings, setup: SchedulerSetup):
        self.settings, self.setup = settings, setup
        self.name = settings.label
        self.L, self.E, self.k = setup.num_layers, setup.num_experts, setup.top_k
        self.cost = setup.cost
        self._clock = 0
        self.last_used = np.zeros((self.L, self.E), dtype=np.int64)
        profile = setup.profile_loads if setup.profile_loads.size else np.zeros((self.L, self.E), dtype=np.int64)
        if profile.shape != (self.L, self.E):
            raise ValueError(f"{self.name}: profile loads have shape {profile.shape}, expected ({self.L}, {self.E})")
        self.profile = profile
        if self.per_layer_cache:
            self.layer_slots = per_layer_slots(self.L, setup.cache_slots)
            self.pinned = np.zeros((self.L, self.E), dtype=bool)
            self._initial = per_layer_hot_table(profile, self.layer_slots) if settings.hot_table \
                else np.zeros((self.L, self.E), dtype=bool)
        else:
            # without a hot table every slot is dynamic: nothing pinned, nothing preloaded
            self.pinned = hot_table(profile, setup.cache_slots - self.dynamic_slots)
            self._initial = hot_table(profile, setup.cache_slots if settings.hot_table else 0)
        if not 0.0 < settings.usage_ema <= 1.0:
            raise ValueError(f"scheduler.usage_ema must lie in (0, 1], got {settings.usage_ema}")
        # `Eviction.token_share` ranks replaceable experts by a moving average of their routed share
        # per pass of their layer (`observe_usage`), never below their long-run share in the profiling
        # runs that built the hot table: at small batches one pass says little (a hot expert idle for a
        # few steps is still hot); at large ones recent use tracks the drifting hot set
        self.profile_share = routed_share(profile, self.k)
        self.usage = self.profile_share.copy()

    @property
    def micro_batches(self) -> int:
        return 1

    @property
    def resident_on_device(self) -> bool:
        """Whether every resident active expert of a layer is always planned on the device (never on the CPU).

        The executor then starts those experts before asking for the plan (they overlap the planning),
        and runs passes with every routed expert resident as one fused call without consulting the
        scheduler (there is nothing to transfer, evict or give the CPU; its usage statistics do not
        advance meanwhile)."""
        return True

    @property
    def dynamic_slots(self) -> int:
        """Cache slots outside the hot table (all of them without a hot table, or one that is not pinned)."""
        if not self.settings.hot_table or not self.settings.pin_hot_table:
            return self.setup.cache_slots
        want = self.settings.dynamic_slots if self.settings.dynamic_slots is not None else self.E
        return int(min(max(want, 0), self.setup.cache_slots))

    def initial_residency(self) -> np.ndarray:
        return self._initial.copy()

    # ---- bookkeeping --------------------------------------------------------------------------
    def touch(self, layer: int, experts: Iterable[int]) -> None:
        """Mark experts of `layer` as used now (LRU)."""
        self._clock += 1
        ids = list(experts)
        if ids:
            self.last_used[layer, ids] = self._clock

    def observe_usage(self, state: LayerState) -> None:
        """Fold this pass's routed shares into the layer's usage average (`usage_ema`)."""
        total = int(state.tokens.sum())
        a = self.settings.usage_ema
        row = self.usage[state.layer]  # a view: updated in place (this runs at every gate)
        row *= 1.0 - a
        if total > 0:
            row += state.tokens * (a * self.k / total)

    def standing(self, layers: Iterable[int], experts: Iterable[int]) -> np.ndarray:
        """float64 [n]: what `Eviction.token_share` ranks by: usage, never below the profile share."""
        flat = self.flat_index(layers, experts)  # 1-D gathers: 2-D fancy indexing of ~2,000 cached experts cost 5x
        return np.maximum(self.usage.reshape(-1)[flat], self.profile_share.reshape(-1)[flat])

    def flat_index(self, layers: Iterable[int], experts: Iterable[int]) -> np.ndarray:
        """int64 [n]: the flat indices of (layer, expert) pairs in an [L, E] array."""
        return np.asarray(layers, dtype=np.int64) * self.E + np.asarray(experts, dtype=np.int64)

    # ---- eviction -------------------------------------------------------------------------------
    def victims(self, state: LayerState, need: int, protect: set[tuple[int, int]]) -> list[tuple[int, int]]:
        """Up to `need` evictable experts of the dynamic region in `eviction_order`."""
        if need <= 0:
            return []
        layers, experts = self.evictable(state, protect)
        if layers.size == 0:
            return []
        order = self.eviction_order(state, layers, experts, need)
        return list(zip(layers[order].tolist(), experts[order].tolist()))

    def evictable(self, state: LayerState, protect: set[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(layers, experts) of the dynamic region that may make room: resident, not pinned, not landing, not in
        `protect`. Under `token_share` the first MoE layer's experts make room only for that layer's own loads: no
        prefetch can bring them back (no forecast runs before the first layer of a pass), so each one given up for
        another layer is a miss on the critical path at every later pass that routes to it."""
        cand = state.resident & ~self.pinned
        if self.settings.eviction is Eviction.token_share and state.layer != 0:
            cand[0] = False
        E = cand.shape[1]
        flat = cand.reshape(-1)  # a view: `cand` is a fresh array
        held = [t.layer * E + t.expert for t in state.inflight] + [layer * E + e for layer, e in protect]
        if held:  # one scatter, not one numpy call per expert (a plan protects up to a layer's every active expert)
            flat[held] = False
        # np.nonzero's (layers, experts) in its row-major order, from the flat indices: 2x faster on a [48, 128] cache
        return np.divmod(np.flatnonzero(flat), E)

    def eviction_order(self, state: LayerState, layers: np.ndarray, experts: np.ndarray, need: int) -> np.ndarray:
        """int [<= need]: indices into the evictable (layers, experts), first victim first: least recently used
        first, or (`token_share`) lowest usage, never below the profile share, then least recently used."""
        lru = self.last_used.reshape(-1)[self.flat_index(layers, experts)]
        if self.settings.eviction is Eviction.token_share:
            usage = self.standing(layers, experts)
            if need < usage.size:  # sort only what can be chosen: usage up to the need-th smallest
                some = np.flatnonzero(usage <= np.partition(usage, need - 1)[need - 1])
                return some[np.lexsort((lru[some], usage[some]))][:need]
            return np.lexsort((lru, usage))
        return np.argsort(lru, kind="stable")[:need]

    def layer_victims(self, state: LayerState, layer: int, need: int, protect: set[int],
                      rank: np.ndarray) -> list[tuple[int, int]]:
        """Up to `need` resident experts of `layer` (not in `protect`, not landing), lowest `rank` first."""
        if need <= 0:
            return []
        flying = state.inflight_experts(layer)
        cand = [e for e in np.flatnonzero(state.resident[layer]).tolist() if e not in protect and e not in flying]
        cand.sort(key=lambda e: (rank[e], e))
        return [(layer, e) for e in cand[:need]]

    def layer_room(self, state: LayerState, layer: int, extra_evicted: int = 0) -> int:
        """Free slots of a per-layer cache: its share minus resident and reserved experts."""
        used = int(state.resident[layer].sum()) + sum(1 for t in state.inflight if t.layer == layer and t.retain)
        return int(self.layer_slots[layer]) - used + extra_evicted

    def next_layer_prefetch(self, state: LayerState, limit: int | None = None) -> list[tuple[int, int]]:
        """(layer + 1, expert) for the next layer's predicted experts not yet available, most predicted tokens
        first (at most `limit`); none without a predictor or a forecast for that layer."""
        target = state.layer + 1
        if not self.settings.use_predictor or target not in state.predicted:
            return []
        pred = state.predicted[target]
        cand = np.flatnonzero(pred > 0)
        cand = cand[~state.available(target)[cand]]
        return [(target, int(e)) for e in by_tokens(cand, pred, descending=True)[:limit]]

    def room_for(self, state: LayerState, want: int, protect: set[tuple[int, int]]) -> tuple[int, list[tuple[int, int]]]:
        """How many of `want` new cache entries fit (pinned + dynamic), and the evictions that make room."""
        free = max(state.free_slots, 0)
        if want <= free:
            return want, []
        evict = self.victims(state, want - free, protect)
        return min(want, free + len(evict)), evict

    def plan_with_slots(self, state: LayerState, cpu: tuple[int, ...], gpu: tuple[int, ...], loads: tuple[int, ...],
                        prefetch: list[tuple[int, int]], keep_working_set: bool = False) -> LayerPlan:
        """A pinned + dynamic cache's plan with slots for its prefetches (and, with `retain_loads`, its
        loads): evictions in `eviction` order; what finds no room is dropped (a load then only passes
        through the staging buffer). `keep_working_set`: the pass may not displace experts standing
        higher than what it brings (see `PreSched.plan`): its loads only pass through staging, a
        prefetch takes a free slot or that of an expert of lower standing, and the forecast does not
        raise the prefetched experts' usage."""
        retain_loads = self.settings.retain_loads and not keep_working_set
        if not prefetch and not (retain_loads and loads):  # nothing to make room for
            return LayerPlan(cpu=cpu, gpu=gpu, ondemand=loads, retain=(False,) * len(loads))
        want = len(prefetch) + (len(loads) if retain_loads else 0)
        free = max(state.free_slots, 0)
        granted, evict = self.room_for(state, want, {(state.layer, e) for e in gpu})
        if keep_working_set and evict:  # victims come lowest standing first, prefetches hottest first
            incoming = self.standing(*zip(*prefetch[free:free + len(evict)]))
            outgoing = self.standing(*zip(*evict))
            granted = min(granted, free + int(np.argmin(np.append(outgoing < incoming, False))))  # leading Trues
        prefetch = prefetch[:granted]
        keep = max(granted - len(prefetch), 0)
        for target, e in prefetch:  # keep fresh prefetches away from the eviction end until their layer runs
            self.last_used[target, e] = self._clock
        if not keep_working_set:
            forecast = {target: routed_share(state.predicted[target], self.k) for target in {t for t, _ in prefetch}}
            for target, e in prefetch:
                self.usage[target, e] = max(self.usage[target, e], forecast[target][e])
        if retain_loads:
            evict = evict[:max(len(prefetch) + min(keep, len(loads)) - free, 0)]
            retain = tuple(i < keep for i in range(len(loads)))
        else:
            evict = evict[:max(len(prefetch) - free, 0)]
            retain = (False,) * len(loads)
        return LayerPlan(cpu=cpu, gpu=gpu, ondemand=loads, retain=retain, prefetch=tuple(prefetch), evict=tuple(evict))


def routed_share(tokens: np.ndarray, top_k: int) -> np.ndarray:
    """float64 [..., E]: each expert's share of its layer's routed tokens, scaled to sum to `top_k`
    (tokens / batch tokens in a pass: comparable between a prefill and a decode step)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    total = tokens.sum(axis=-1, keepdims=True)
    return np.divide(tokens * top_k, total, out=np.zeros_like(tokens), where=total > 0)


def split_by_availability(state: LayerState) -> tuple[np.ndarray, np.ndarray]:
    """(ready, missing): active experts of this layer that are / are not resident or landing. Made once per layer state
    (PreSched's plan and Horizon's candidate splits both ask): read-only arrays."""
    both = state.__dict__.get("_by_availability")
    if both is None:
        active = state.active
        avail = state.available(state.layer)[active]
        both = state.__dict__["_by_availability"] = (active[avail], active[~avail])
        for part in both:
            part.setflags(write=False)
    return both


class ExpertTimes(NamedTuple):
    """Per expert of a layer (lists over every expert id): tokens, GPU time in a call of its own, CPU time."""

    tokens: list[float]
    gpu: list[float]
    cpu: list[float]


def expert_times(tokens: np.ndarray, cost) -> ExpertTimes:
    """`ExpertTimes` of a layer's token counts (int [E]; elementwise `t_g` / `t_c`: the values each expert's own
    `t_g(m)` / `t_c(m)` gives; integer counts through `CostModel.count_times`' tables, the same values)."""
    tokens = np.asarray(tokens)
    if is_counts(tokens):
        t_g, t_c, _ = cost.count_times(tokens)
        return ExpertTimes(tokens.tolist(), t_g.tolist(), t_c.tolist())
    return ExpertTimes(tokens.tolist(), np.atleast_1d(cost.t_g(tokens)).tolist(), np.atleast_1d(cost.t_c(tokens)).tolist())


def is_counts(tokens: np.ndarray) -> bool:
    """Whether `tokens` are non-negative integer counts (`CostModel.count_times` looks them up)."""
    return tokens.dtype.kind in "iu" and tokens.ndim == 1 and (tokens.size == 0 or int(tokens.min()) >= 0)


def layer_expert_times(state: LayerState) -> ExpertTimes:
    """`expert_times` of `state`'s tokens, made once per layer state: PreSched's walk, Horizon's candidate splits
    (HybriMoE's HSS, DALI's list, `layer_time`) and DALI's own plan read the same per-expert times."""
    times = state.__dict__.get("_expert_times")
    if times is None:
        times = state.__dict__["_expert_times"] = expert_times(state.tokens, state.cost)
    return times


def by_tokens(experts: np.ndarray, tokens: np.ndarray, descending: bool = False) -> np.ndarray:
    """`experts` sorted by `tokens[experts]` (stable: ties keep expert-id order)."""
    key = -tokens[experts] if descending else tokens[experts]
    return experts[np.argsort(key, kind="stable")]


def gpu_only_plan(state: LayerState, order: np.ndarray, retain: bool = False,
                  prefetch: tuple[tuple[int, int], ...] = (), evict: tuple[tuple[int, int], ...] = ()) -> LayerPlan:
    """Every active expert on the GPU; the missing ones loaded in `order`."""
    ready, _ = split_by_availability(state)
    loads = tuple(int(e) for e in order)
    return LayerPlan(cpu=(), gpu=tuple(int(e) for e in ready) + loads, ondemand=loads,
                     retain=(retain,) * len(loads), prefetch=prefetch, evict=evict)
