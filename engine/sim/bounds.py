"""How far from optimal a schedule is: a lower bound no schedule can beat, and an exact search.

**Lower bound** (any schedule in this machine model: any CPU/GPU split, any transfers, any cache
policy). Per MoE layer with n active experts, a split with j experts on the CPU takes at least
A(j) = t_attn + max(t_c of the j coldest experts, shared + t_g of the n - j coldest experts), since
the CPU and GPU both start after the gate and the layer ends when both are done (the cheapest
j-set for each device is a valid bound even though the two cannot both be the coldest). A pass takes
at least the sum over its MoE layers plus its dense layers and head. An expert computed on the GPU
was resident when the pass began (at most `cache + staging` experts) or crossed the serial link
during the pass (the mechanism's transfers serve later layers of the pass that issues them), so a
pass with G GPU experts keeps the link busy at least (G - C)+ t_io within its own span. A pass thus
takes at least max(compute, link) >= (1 - lam) compute + lam * nu * (G - C) t_io for any lam, nu
in [0, 1]; for fixed multipliers the layer choices separate, so each pass's bound is the maximum
over a grid of multipliers, and the run's bound their sum.

**Exact search** (small instances): the best schedule of one forward pass over every per-layer
decision the mechanism accepts in LayerScope's action space (hot table fixed): any subset of the
missing experts on the CPU (the rest loaded, hottest first) and any subset of the next layer's truly
active missing experts prefetched (hottest first); timings from the simulator itself. Dynamic
programming over layers keeps, per set of in-flight / landed prefetches, the states not dominated in
(time, transfer end times), and prunes with the lower bound of the remaining layers.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from itertools import combinations
from typing import Iterable, Optional, Sequence

import numpy as np

from engine.sim.pipeline import PipelineSim, SimOptions
from engine.sim.workload import ForwardPass
from core.trace import RoutingTrace
from models.config import ModelConfig
from schedulers.base import LayerPlan, LayerState, SchedulerSettings
from schedulers.cost import CostModel

_LAMBDAS = np.linspace(0.0, 1.0, 21)
_NUS = np.linspace(0.0, 1.0, 11)


def layer_floor(cost: CostModel, tokens: np.ndarray, t_attn: float, t_shared: float) -> np.ndarray:
    """A(j), j = 0..n: the least time of an MoE layer whose n active experts put j on the CPU."""
    m = np.sort(tokens[tokens > 0]).astype(np.float64)
    n = m.size
    tc = np.concatenate([[0.0], cost.t_c_prefix(m)]) if n else np.zeros(1)
    tg = np.concatenate([[0.0], np.cumsum(cost.t_g_group(m))]) if n else np.zeros(1)  # one device call at best
    j = np.arange(n + 1)
    gpu = np.where(n - j > 0, t_shared + tg[n - j], t_shared)
    return t_attn + np.maximum(tc[j], gpu)


def pass_fixed_time(cfg: ModelConfig, cost: CostModel, fp: ForwardPass) -> tuple[float, float, float]:
    """(attention per MoE layer, shared experts per MoE layer, dense layers + head of the pass)."""
    if fp.prefill:
        t_attn = cost.t_attn(fp.num_seqs, 0, prefill=True, prompt_len=fp.context_len)
    else:
        t_attn = cost.t_attn(fp.num_seqs, fp.context_len)
    n_dense = cfg.num_hidden_layers - len(cfg.moe_layers)
    fixed = n_dense * (t_attn + cost.t_dense_mlp(fp.tokens)) + cost.t_head(fp.num_seqs) + cost.pass_overhead_s
    # the fixed host time of every MoE layer comes before its plan, like attention
    return t_attn + cost.layer_overhead_s, cost.t_shared(fp.tokens), fixed


def lower_bound(cfg: ModelConfig, cost: CostModel, passes: Iterable[ForwardPass], resident_capacity: int,
                t_io: Optional[float] = None) -> float:
    """Seconds no schedule of these passes can beat (module docstring); `resident_capacity` = cache + staging."""
    t_io = cost.t_io if t_io is None else t_io
    lam = _LAMBDAS[:, None]
    nu = _NUS[None, :]
    total = 0.0
    for fp in passes:
        t_attn, t_shared, fixed = pass_fixed_time(cfg, cost, fp)
        value = (1 - lam) * fixed - lam * nu * t_io * resident_capacity  # [lambda, nu]
        total += float(pass_layers(cost, fp, t_io, t_attn, t_shared, value).max())
    return total


def pass_layers(cost: CostModel, fp: ForwardPass, t_io: float, t_attn: float, t_shared: float,
                value: np.ndarray) -> np.ndarray:
    """float64 [lambda, nu]: `value` plus, per MoE layer of `fp`, min over j of (1 - lam) A(j) + lam nu io(j) (io(j):
    the transfers if every GPU expert had to move), for every multiplier pair."""
    lam = _LAMBDAS[:, None]
    nu = _NUS[None, :]
    for layer in range(fp.loads.shape[0]):
        a = layer_floor(cost, fp.loads[layer], t_attn, t_shared)
        n = a.size - 1
        io = (n - np.arange(n + 1)) * t_io  # transfers if every GPU expert had to move
        value = value + np.min((1 - lam)[..., None] * a + (lam * nu)[..., None] * io, axis=-1)
    return value


# ---- a bound whose cache carries over from pass to pass ---------------------------------------------
def most_hits(loads: Sequence[np.ndarray], capacity: int) -> int:
    """The most expert uses of these passes (int [L, E] tokens each, in run order) that any cache of `capacity`
    experts can serve without a transfer, knowing the routing: a use of expert e of layer l is a hit only where (l, e)
    stayed cached since its previous use (the previous pass that routed to it, at the latest), or since the start
    for its first use (the starting cache is free). Each such use needs a slot over (previous use, this use] on the
    gate clock (pass x layers + layer); a cache is `capacity` slots, so the hits are at most the largest set of these
    intervals that `capacity` slots hold with no two on one slot at once. Intervals by right end, each to the slot
    freed latest at or before its start (none: it is dropped) gives that largest set (the greedy that is optimal for
    unweighted intervals on k identical machines; `tests/test_bounds.py` checks it by brute force)."""
    if capacity <= 0 or not loads:
        return 0
    L, E = loads[0].shape
    starts, ends = [], []
    last = np.full((L, E), -1, dtype=np.int64)  # the gate of each (layer, expert)'s previous use; -1: the start
    clock = np.arange(L)[:, None]
    for p, tokens in enumerate(loads):
        used = tokens > 0
        here = np.broadcast_to(p * L + clock, (L, E))
        starts.append(last[used])
        ends.append(here[used])
        last = np.where(used, here, last)
    start, end = np.concatenate(starts), np.concatenate(ends)
    order = np.lexsort((-start, end))  # by right end; ties: the shorter first
    free = [-1] * capacity  # per slot, the gate its last interval ended at (sorted)
    hits = 0
    for a, b in zip(start[order].tolist(), end[order].tolist()):
        i = bisect_right(free, a) - 1  # the slot freed latest at or before a
        if i >= 0:
            del free[i]
            insort(free, b)
            hits += 1
    return hits


def continuity_bound(cfg: ModelConfig, cost: CostModel, passes: Sequence[ForwardPass], resident_capacity: int,
                     t_io: Optional[float] = None) -> float:
    """Seconds no schedule of these passes can beat, with the cache carried from pass to pass: still clairvoyant about
    the routing (an upper bound's knowledge, like `lower_bound`), but a decode pass no longer starts from the best
    cache for its own routing. Prefill passes as in `lower_bound`. The decode passes together: the run takes at
    least its compute and at least its link time, so for every multiplier pair (lam, nu) in [0, 1]^2 at least
    sum over passes of (1 - lam) compute + lam nu t_io (GPU experts - hits), where the hits over the whole decode run
    are at most `most_hits` (the cache's continuity) instead of `resident_capacity` per pass; the layer choices
    separate as in `lower_bound`. One multiplier pair for every decode pass (a load may serve a later pass, so the
    link's time cannot be split by pass): the bound is the larger of this and `lower_bound` of the decode passes."""
    t_io = cost.t_io if t_io is None else t_io
    prefill = [fp for fp in passes if fp.prefill]
    decode = [fp for fp in passes if not fp.prefill]
    total = lower_bound(cfg, cost, prefill, resident_capacity, t_io)
    if not decode:
        return total
    lam = _LAMBDAS[:, None]
    nu = _NUS[None, :]
    value = -lam * nu * t_io * most_hits([fp.loads for fp in decode], resident_capacity)
    for fp in decode:
        t_attn, t_shared, fixed = pass_fixed_time(cfg, cost, fp)
        value = pass_layers(cost, fp, t_io, t_attn, t_shared, value + (1 - lam) * fixed)
    return total + max(float(value.max()), lower_bound(cfg, cost, decode, resident_capacity, t_io))


# ---- a bound with per-layer splits and the slots charged per segment of layers -------------------
def convex_slopes(values: np.ndarray) -> tuple[float, np.ndarray]:
    """(f(0), slopes) of the lower convex envelope of `values` (f(g), g = 0..n, float [n + 1]): f(0) plus the first g
    slopes (ascending) is the envelope at g, which is at most `values[g]` (equal where `values` is convex)."""
    hull = [0]
    for g in range(1, values.size):  # the lower hull of the points (g, f(g)), left to right
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (values[b] - values[a]) * (g - a) >= (values[g] - values[a]) * (b - a):
                hull.pop()  # b lies on or above the chord from a to g
            else:
                break
        hull.append(g)
    slopes = [np.full(b - a, (values[b] - values[a]) / (b - a)) for a, b in zip(hull, hull[1:])]
    return float(values[0]), np.concatenate(slopes) if slopes else np.zeros(0)


def segment_value(base: float, slopes: np.ndarray, capacity: int, t_io: float) -> float:
    """min over integer G (GPU uses of the segment) of max(compute(G), t_io (G - capacity)+), compute(G) = `base` plus
    the G smallest of `slopes` (the segment's layers' envelopes merged: their least compute with G uses on the GPU)."""
    compute = base + np.concatenate([[0.0], np.cumsum(np.sort(slopes))])
    link = t_io * np.maximum(np.arange(compute.size) - capacity, 0)
    return float(np.maximum(compute, link).min())


def pass_segments(cfg: ModelConfig, cost: CostModel, fp: ForwardPass, capacity: int, t_io: float) -> float:
    """The segment bound of one pass (`segment_bound`): its trailing dense layers, head and fixed host time, plus the
    most, over the ways to cut its MoE layers into consecutive segments, of the segments' `segment_value`s."""
    t_attn, t_shared, _ = pass_fixed_time(cfg, cost, fp)
    raw_attn = t_attn - cost.layer_overhead_s
    dense = raw_attn + cost.t_dense_mlp(fp.tokens)  # one dense decoder layer (the simulator's `t_dense`)
    before = dense_layers_before(cfg)
    tail = before[-1] * dense + cost.t_head(fp.num_seqs) + cost.pass_overhead_s
    layers = []
    for layer in range(fp.loads.shape[0]):
        floor = layer_floor(cost, fp.loads[layer], t_attn, t_shared)  # by CPU experts j; as GPU uses g = n - j:
        layers.append(convex_slopes(floor[::-1] + before[layer] * dense))
    L = len(layers)
    best = np.zeros(L + 1)  # best[b]: the most the first b layers' segments add up to
    best[1:] = -np.inf
    for a in range(L):
        base, slopes = 0.0, np.zeros(0)
        for b in range(a, L):  # the segment of layers a..b
            base, slopes = base + layers[b][0], np.concatenate([slopes, layers[b][1]])
            best[b + 1] = max(best[b + 1], best[a] + segment_value(base, slopes, capacity, t_io))
    return float(best[L]) + tail


def dense_layers_before(cfg: ModelConfig) -> list[int]:
    """int [L + 1]: the dense decoder layers before each MoE layer, and (last) after the last one."""
    out = [0] * (len(cfg.moe_layers) + 1)
    moe, i = set(cfg.moe_layers), 0
    for layer in range(cfg.num_hidden_layers):
        if layer in moe:
            i += 1
        else:
            out[i] += 1
    return out


def segment_bound(cfg: ModelConfig, cost: CostModel, passes: Iterable[ForwardPass], resident_capacity: int,
                  t_io: Optional[float] = None) -> float:
    """Seconds no schedule of these passes can beat, with each MoE layer's CPU/GPU split whole (not mixed across a
    pass by multipliers) and the slots charged per segment of layers: still clairvoyant about the routing.

    Proof. Take any schedule of the machine model (the simulator's: a serial link, `resident_capacity` slots holding
    every resident or in-flight expert, one pass after another; a layer's dense layers, attention, then its experts;
    it ends when its CPU and GPU experts are both done). Let E_l be the end of MoE layer l of a pass, E_0 the pass's
    start; the intervals (E_{l-1}, E_l] are disjoint and hold, besides layer l itself, only the dense layers before
    it; the trailing dense layers, the head and the pass's fixed host time come after E_L (`tail`). Cut layers 1..L
    into consecutive segments a..b. (i) Compute: layer l with j experts on the CPU takes at least A_l(j) (`layer_floor`)
    plus its dense layers, so E_b - E_{a-1} >= the sum over a..b. (ii) Link: each of the segment's G GPU uses is a
    distinct (layer, expert); at E_{a-1} at most C = `resident_capacity` of them are resident or in flight, so at least
    (G - C)+ transfers start after E_{a-1} and land before E_b (before their layer's GPU work), one at a time:
    E_b - E_{a-1} >= t_io (G - C)+. So the pass takes at least tail + sum over segments of max((i), (ii)) for the
    schedule's splits, for every cut. The bound relaxes (1) the splits: each segment takes its own least (the max over
    cuts of the min over splits, not the min of the max), (2) within a layer, A_l as a function of its GPU uses is
    replaced by its lower convex envelope (`convex_slopes`, exact where A_l is convex; below it, so still a lower
    bound), which lets a segment's least compute at G uses be its layers' merged slopes, (3) A_l's coldest-set
    relaxation of `layer_floor`, (4) the fluid link (t_io per transfer, no latency) and (5) which experts hold the C
    slots (any C of the segment's uses, as if chosen with the routing known). With one segment and no envelope it is
    min over splits of max(compute, link) >= the multiplier bound `lower_bound` (weak duality), and every cut is tried,
    so it is never below `lower_bound` up to its multiplier grid; the larger of the two is returned per pass."""
    t_io = cost.t_io if t_io is None else t_io
    total = 0.0
    for fp in passes:
        own = pass_segments(cfg, cost, fp, resident_capacity, t_io)
        total += max(own, lower_bound(cfg, cost, [fp], resident_capacity, t_io))
    return total


def compute_floor(cfg: ModelConfig, cost: CostModel, fp: ForwardPass, layers: Iterable[int]) -> float:
    """The compute-only bound of some MoE layers of one pass (their A(j) minimised, no I/O)."""
    t_attn, t_shared, _ = pass_fixed_time(cfg, cost, fp)
    return float(sum(layer_floor(cost, fp.loads[layer], t_attn, t_shared).min() for layer in layers))


# ---- exact search ---------------------------------------------------------------------------------
class ScriptedPolicy:
    """A scheduler that returns the plan it is handed (the search drives it)."""

    micro_batches = 1

    def __init__(self, residency: np.ndarray):
        self.name = "oracle-search"
        self.settings = SchedulerSettings(label="Oracle (exact)")
        self._residency = residency
        self.next_plan: Optional[LayerPlan] = None
        self.last_state: Optional[LayerState] = None

    def initial_residency(self) -> np.ndarray:
        return self._residency.copy()

    def plan(self, state: LayerState) -> LayerPlan:
        assert self.next_plan is not None
        return self.next_plan


def _subsets(items: list[int]) -> list[tuple[int, ...]]:
    return [c for r in range(len(items) + 1) for c in combinations(items, r)]


def _dominated(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """True when state b is at least as good as a in every coordinate."""
    return all(y <= x + 1e-12 for x, y in zip(a, b))


def exact_best_pass(cfg: ModelConfig, cost: CostModel, trace: RoutingTrace, fp: ForwardPass, pinned: np.ndarray,
                    cache_slots: int, staging_slots: int = 2, async_io: bool = True, upper_bound: float = float("inf"),
                    max_states: int = 200_000, initial: Optional[np.ndarray] = None) -> tuple[float, list[LayerPlan]]:
    """The least duration of pass `fp` from an idle link and a cache holding `initial` (bool [L, E];
    default: only the `pinned` experts), and its plans. A prefetch that needs room evicts unpinned
    experts this pass no longer uses (earlier layers, or routed no tokens in `fp`).

    Raises ValueError when the instance needs more than `max_states` layer simulations.
    """
    policy = ScriptedPolicy(pinned if initial is None else initial | pinned)
    sim = PipelineSim(cfg=cfg, cost=cost, scheduler=policy, cache_slots=cache_slots, staging_slots=staging_slots,
                      trace=trace, options=SimOptions(async_io=async_io, check_invariants=True))
    L = len(cfg.moe_layers)
    ctx = sim.start_pass(fp)
    rest_floor = [compute_floor(cfg, cost, fp, range(layer, L)) for layer in range(L)] + [0.0]
    frontier: list[tuple[tuple, list[LayerPlan]]] = [(sim.snapshot(), [])]
    budget = max_states
    for layer in range(L):
        groups: dict[tuple, list[tuple[tuple[float, ...], tuple, list[LayerPlan]]]] = {}
        tokens = fp.loads[layer]
        nxt_tokens = fp.loads[layer + 1] if layer + 1 < L else None
        for snap, plans in frontier:
            sim.restore(snap)
            gate = sim.now + sim._dense_before[layer] * ctx.t_dense + ctx.attn_parts[0]
            sim._settle(gate)  # what is resident or landing at this layer's gate
            avail = sim.resident[layer].copy()
            for job in sim.jobs:
                if job.layer == layer:
                    avail[job.expert] = True
            active = np.flatnonzero(tokens)
            ready = [int(e) for e in active if avail[e]]
            missing = sorted((int(e) for e in active if not avail[e]), key=lambda e: -tokens[e])
            cands: list[int] = []
            if nxt_tokens is not None:
                nxt_avail = sim.resident[layer + 1].copy()
                for job in sim.jobs:
                    if job.layer == layer + 1:
                        nxt_avail[job.expert] = True
                cands = sorted((int(e) for e in np.flatnonzero(nxt_tokens) if not nxt_avail[e]),
                               key=lambda e: -nxt_tokens[e])
            for cpu in _subsets(missing):
                loads = tuple(e for e in missing if e not in cpu)
                for pref in _subsets(cands):
                    budget -= 1
                    if budget < 0:
                        raise ValueError(f"exact search: more than {max_states} layer simulations; use a smaller instance")
                    sim.restore(snap)
                    free = cache_slots - sim.n_resident - sum(1 for j in sim.jobs if j.retain)
                    evict: list[tuple[int, int]] = []
                    if len(pref) > free:  # landed prefetches of earlier layers are dead weight in one pass
                        dead = [(lay, e) for lay in range(L) for e in np.flatnonzero(sim.resident[lay] & ~pinned[lay])
                                if lay < layer or fp.loads[lay][e] == 0]
                        evict = [(int(a), int(b)) for a, b in dead[:len(pref) - free]]
                        if len(evict) < len(pref) - free:
                            continue
                    policy.next_plan = LayerPlan(cpu=tuple(sorted(cpu)), gpu=tuple(ready) + loads, ondemand=loads,
                                                 prefetch=tuple((layer + 1, e) for e in pref), evict=tuple(evict))
                    sim.step_layer(ctx, layer)
                    if sim.now + rest_floor[layer + 1] >= upper_bound - 1e-12:
                        continue
                    key = tuple((j.layer, j.expert) for j in sim.jobs) + tuple(
                        map(tuple, np.argwhere(sim.resident & ~pinned).tolist()))
                    score = (sim.now,) + tuple(j.end for j in sim.jobs)
                    bucket = groups.setdefault(key, [])
                    if any(_dominated(score, other) for other, _, _ in bucket):
                        continue
                    bucket[:] = [b for b in bucket if not _dominated(b[0], score)]
                    bucket.append((score, sim.snapshot(), plans + [policy.next_plan]))
        frontier = [(snap, plans) for bucket in groups.values() for _, snap, plans in bucket]
        if not frontier:
            return upper_bound, []
    best_time, best_plans = float("inf"), []
    for snap, plans in frontier:
        sim.restore(snap)
        duration = sim.finish_pass(ctx)
        if duration < best_time:
            best_time, best_plans = duration, plans
    return best_time, best_plans
