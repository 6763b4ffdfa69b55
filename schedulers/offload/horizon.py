"""Horizon: moescope's default offload scheduler. PreSched's cross-layer plan, its CPU/GPU split chosen
among several candidates by the layer time the cost model predicts, and two batches in flight (Klotski's reason
for its multi-batch pipeline; with one micro-batch, a batch twice as large).

Per MoE layer, after its gate:

1. **PreSched's plan** (`schedulers.offload.presched`, Algorithm 1 with moescope's extensions): the split of
   eq. 4, the prefetches of eqs. 5-6 and Q4, the pinned-nothing token-share cache. Its bookkeeping (usage
   average, LRU stamps) is the cache's, whichever split runs.
2. **Candidate splits**, each a (CPU experts, GPU experts, on-demand loads hottest first):
   PreSched's own; eq. 1's per-layer optimum with the GPU's work on resident experts counted (`greedy_split`);
   HybriMoE's hybrid scheduling (cached experts first, the GPU taking from the front and the CPU from the back,
   `hybrid_scheduling`), only where resident experts may run on the CPU (`resident_on_device` off); DALI's greedy
   0-1 list assignment (`list_split`: hottest first, each expert to the side that finishes it first); and
   "every missing expert on the CPU" / "every missing expert loaded". Each is timed with one estimator,
   `layer_time`, that plays the layer the way the mechanism runs it: the shared experts and the resident
   experts in one device call, the experts landing from started transfers at their arrival, the loads one
   after another on the serial link behind `alpha` (each computed when it lands), the CPU experts one after
   another with one hand-over.
3. **Split and prefetches chosen together, over two layers** (`prefetch_counts`, default 4). PreSched sizes its
   prefetches by eq. 5's idle link time under its own split; another split leaves the link a different idle
   time (one that loads more leaves none: PreSched's count then delays the next layer's loads behind
   prefetches; one that computes more on the CPU leaves more than eq. 5 counted). So for every candidate split
   and every count k = 0..4 of the next layer's hottest forecast experts not cached (its E_next), the plan adds
   to the split's `layer_time` the next layer's time as the forecast shows it (`next_layer_times`: its cached
   predicted experts in one call, the k prefetched ones landing behind the link time this layer's loads and
   prefetches leave owed at its gate, the rest split the best way between the CPU, coldest first, and loads),
   and runs the pair that ends both layers soonest (ties: fewer prefetches, PreSched's split). Where the next
   layer has no forecast or nothing of it is missing, or where copies take host cores (`link_cpu_share` > 0, the
   CPU backend: PreSched's rules charge them to the CPU side), the fastest split runs with PreSched's prefetches
   (Q4's later targets). Slots for the prefetches, then for kept loads, as PreSched makes them. A prefill pass
   runs the fastest candidate split too (`prefill_candidates`), with PreSched's prefill prefetches.
   **The search is paid for only where it saves more than the run charges for it** (`skips_search`): a decode plan
   keeps PreSched's plan unsearched where the searches at this batch lately saved less than the search's price on
   average (the cost model's own two-layer estimate, the mean of the last `saving_window` searched plans of every
   layer, once a pass of them has run: one layer's savings come in bursts), or, where the search weighs this layer
   alone (no forecast of the next), where PreSched's split ends sooner than the price. Every `search_probe`-th plan
   of a layer probes; a probe that still finds it not paying doubles the interval, up to `search_probe_max`. The
   price is what the run charges (`SchedulerSetup.planning`, `schedulers.base.PlanningPrice`): nothing where planning
   is free (the simulator's default, `simulate.planning` off: every plan searches, bit for bit the plans of always
   searching), else the search's own time on the clock the run charges by (the executor's wall time; the
   simulator's `measured` / `measured_cpu` charge), the running median of the last `search_window` of every 4th
   search timed at this batch, plus any fixed price (`planning.search_us`). `search_cost_us` fixes the price instead
   (`conf/scheduler/horizon_budget.yaml`: 300 µs; `horizon_search`: 0, always search).
4. **Eviction by next use** (`evict_next_use`): a pass runs the layers in order, so of the cached experts that
   may make room, the one with the lowest usage per layer until its layer comes back goes first (then least
   recently used). With every expert routed at every pass (large batches, usage alike) that is the one whose
   layer comes back last (Belady's rule on the layer cycle): any eviction costs a miss later, and this one is the
   miss the link has the most layers to bring back; a cold expert still goes before a hot one. By the same key a
   load stays cached only where it beats the expert it would displace (`admit_loads`: a load of this layer is next
   used a whole pass later).
5. **Batches in flight** (`batches_in_flight`, default 2): `batch_size` x 2 sequences go through the layers
   together, one executor batch, each expert's weights crossing the link once for both (Klotski's reason for
   its pipeline, §5.1 of LayerScope: "two micro-batch parallelism"). Unlike Klotski the plan stays
   PreSched's hybrid one, and the two batches are one micro-batch (`micro_batches` 1): a second device call
   per expert costs more than overlapping the second batch's attention gains on every profile here
   (measured: `engine/bench/bench_horizon_study.py` rows `horizon_mb2`). The price is latency: a decode
   step serves twice the sequences, so each sequence's tokens come at most twice as far apart (the study
   reports decode latency beside throughput); `batches_in_flight: 1` gives the per-batch policy.

6. **Prefetches across the decode-step boundary** (`next_step_layers`, default 0: off; `next_step_prefetch`). No
   forecast reaches past a step, so the first layers of every step start with what the cache holds. With it on, the
   last MoE layer's plan also prefetches experts the first `next_step_layers` MoE layers routed in this step (the same
   sequences' next token: temporal locality), as many as the link's idle time before the next step's first gate holds,
   each only where it is needed sooner than what it displaces. Measured (README "Where the bound is loose, and why"):
   median -0.005 %, -1.27 % to +0.08 % over the 40 equal-concurrency points (`engine/bench/bench_cross_step.py`), so
   it stays off: the cache is full at the last layer, so each one evicts an expert that then misses in its own layer.

Why steps 3-4: on the four regimes rows where Horizon with PreSched's prefetches closed less than half the gap to
the bound (README "Offload scheduler: Horizon"), at cache 60 % of experts (seed 0) 4,701 of 5,222 transfers were
on-demand loads, each waited for after its gate; with steps 3-4, 3,610 of 5,153, and 93.65 -> 100.96 tok/s.

No forecast is read beyond what PreSched reads (the next layers' predictions through `LayerState.predicted`,
made by an online predictor from what has run so far; Horizon reads the next layer's at every decode plan, where
PreSched reads it when its eq. 4 passes): the plan of layer l depends on the routing of layers
<= l, the cache and the link, never on later routing (`tests/test_horizon.py` proves it by changing the
routing after l).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Sequence

import numpy as np

from schedulers.base import LayerPlan, LayerState, Phase, SchedulerSetup, register
from schedulers.offload.dali import greedy_assignment
from schedulers.offload.hybrimoe import hybrid_scheduling
from schedulers.offload.layerwise import greedy_split
from schedulers.offload.presched import Lookahead, PreSched, PreSchedSettings
from schedulers.policy import is_counts, layer_expert_times, split_by_availability


@dataclass(frozen=True)
class HorizonSettings(PreSchedSettings):
    """Horizon's knobs beside PreSched's (conf/scheduler/horizon.yaml)."""

    kind: str = "horizon"
    label: str = "Horizon"
    batches_in_flight: int = 2  # batches of `batch_size` sequences run through the layers together
    micro_batches: int = 1  # device calls per expert and layer (each in-flight batch its own call: 2)
    # splits compared per layer
    candidates: tuple[str, ...] = ("presched", "greedy", "hss", "dali", "all_cpu", "all_gpu")
    # the most prefetches of the next layer's forecast experts each decode plan weighs (0, 1, ..., this many, timed
    # with the split over this layer and the next); 0: PreSched's eq. 5-6 prefetches, whatever split wins
    prefetch_counts: int = 4
    evict_next_use: bool = True  # evict the cached expert whose layer comes back last first (else PreSched's order)
    # what the candidate splits and the two-layer search cost per decode plan beyond PreSched's plan, in host µs. A
    # decode layer keeps PreSched's plan, unsearched, where the searches at this batch have lately saved less than this
    # on average by the cost model's own estimate (the searched plans' two-layer time against PreSched's split and
    # prefetch count; every `search_probe`-th plan of a layer searches anyway, to keep it current), or where the search
    # weighs this layer alone (no forecast of the next) and PreSched's split ends sooner than this. None (default): what
    # the run charges for it (`SchedulerSetup.planning`): nothing where planning is free (the simulator's default:
    # always search), else the search's own time on the run's clock (the running median of its last `search_window`
    # searches at this batch) plus any fixed price. A number: that, whatever the run charges (0: always search;
    # conf/scheduler/horizon_budget.yaml: a fixed 300 µs)
    search_cost_us: Optional[float] = None
    search_probe: int = 8
    # a probe after which the searches still save less than they cost doubles that layer's probe interval, up to this
    # (a search that saves more sets it back to `search_probe`): a probe costs a whole search, and where the search
    # does not pay (a short layer at a GPU's roofline) probing every 8th plan would cost an eighth of it anyway
    search_probe_max: int = 64
    search_window: int = 31  # searches whose measured time the running median takes (per batch size)
    saving_window: int = 256  # searched plans whose estimated saving the mean takes (per batch size)
    # a prefill pass runs the fastest candidate split too (else PreSched's eq. 1 split, resident experts on the GPU)
    prefill_candidates: bool = True
    # a load stays cached only where it is needed sooner (usage per layer until its next use) than what it displaces
    admit_loads: bool = True
    # prefetch across the decode-step boundary (`next_step_prefetch`): at the last MoE layer of a decode step, load the
    # experts this step routed at the first `next_step_layers` MoE layers (the same sequences' next token: temporal
    # locality) that are not cached, as many as the link's idle time until the next step's first gate holds and each
    # only where it beats the expert it displaces by the eviction key; 0: off (no forecast reaches past the step)
    next_step_layers: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.candidates) - set(SPLITS)
        if unknown or not self.candidates:
            raise ValueError(f"scheduler.candidates: {sorted(unknown) or '[]'} not among {sorted(SPLITS)}")
        if not 1 <= self.search_probe <= self.search_probe_max:
            raise ValueError(f"scheduler.search_probe ({self.search_probe}) must be >= 1 and <= "
                             f"scheduler.search_probe_max ({self.search_probe_max})")
        if self.search_cost_us is not None and not self.search_cost_us >= 0:
            raise ValueError(f"scheduler.search_cost_us ({self.search_cost_us}) must be >= 0 or null (the run's price)")
        if self.search_window < 1 or self.saving_window < 1:
            raise ValueError(f"scheduler.search_window ({self.search_window}) and scheduler.saving_window "
                             f"({self.saving_window}) must be >= 1")
        if self.next_step_layers < 0:
            raise ValueError(f"scheduler.next_step_layers ({self.next_step_layers}) must be >= 0")
        if self.prefetch_counts < 0:
            raise ValueError(f"scheduler.prefetch_counts ({self.prefetch_counts}) must be >= 0")
        if self.batches_in_flight < 1 or self.micro_batches < 1:
            raise ValueError(f"scheduler.batches_in_flight ({self.batches_in_flight}) and scheduler.micro_batches "
                             f"({self.micro_batches}) must be >= 1")

    @property
    def in_flight(self) -> int:
        return self.batches_in_flight


SPLITS = ("presched", "greedy", "hss", "dali", "all_cpu", "all_gpu")


class Split(NamedTuple):
    """One candidate: experts of this layer on the CPU, on the GPU, and the GPU ones loaded now (link order). A named
    tuple: six are made per plan (a frozen dataclass's `__init__` cost a microsecond more each)."""

    name: str
    cpu: tuple[int, ...]
    gpu: tuple[int, ...]
    loads: tuple[int, ...]


_QUEUE_NUMPY_FROM = 32  # `layer_time` plays a link queue longer than this in numpy (numpy's per-call cost amortised)


def layer_time(state: LayerState, split: Split, held: Sequence[int] = ()) -> float:
    """Seconds from the gate until the layer's CPU and GPU sides are both done, as the mechanism runs `split`:
    shared + resident experts in one call, landing ones at arrival, loads serial on the link behind `alpha`
    (behind the held prefetches too), each computed on landing; the CPU experts one after another."""
    cost = state.cost
    landing, shared, _, tok, t_g, _ = layer_parts(state)
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
            gpu = max(gpu, landing[e]) + t_g[e]
    # the held prefetches, then the loads, land one t_io apart behind alpha; each is computed on landing:
    # g_k = max(g_{k-1}, link_k) + t_k unrolls to max(g_0 + sum t, max_k(link_k + sum_{j >= k} t_j))
    queue = [e for e in split.gpu if e in held] + list(split.loads) if held else split.loads
    if queue:
        alpha, t_io = state.alpha_s, state.t_io_s
        if len(queue) > _QUEUE_NUMPY_FROM:  # the same sums, in the same order, in four array calls
            tails = np.cumsum([t_g[e] for e in reversed(queue)])  # np.cumsum adds left to right, as the loop below
            tail = float(tails[-1])
            last = float(np.max(alpha + t_io * np.arange(len(queue), 0, -1) + tails))
        else:
            tail, last = 0.0, -math.inf
            for k in range(len(queue) - 1, -1, -1):  # tail sums from the last load back, as a reversed cumsum adds
                tail += t_g[queue[k]]
                done = alpha + t_io * (k + 1) + tail
                if done > last:  # max() without its call
                    last = done
        gpu = max(gpu + tail, last)
    cpu = cost.t_c_sum([tok[e] for e in split.cpu])
    s = cost.device_cpu_share  # where the device is the host, each side also waits for its share of the other
    return max(cpu + s * gpu, gpu + s * cpu) if s > 0 else max(cpu, gpu)


class LayerParts(NamedTuple):
    """What the candidate splits of one plan share, built once per layer state (`layer_parts`)."""

    landing: dict[int, float]  # this layer's landing experts -> seconds to arrival
    shared: float  # the shared experts' GPU time
    groups: dict[tuple[int, ...], float]  # the memo of `group_time`
    tokens: list[int]  # tokens per expert
    t_g: list[float]  # each expert's `cost.t_g` (a call of its own)
    in_group: list[float]  # each expert's `cost.t_g_group` share (in a call with others; the call's dispatch apart)


def layer_parts(state: LayerState) -> LayerParts:
    """The `LayerParts` of `state`, made on first use. The per-expert GPU times of all E experts are two numpy calls
    (the splits asked for them expert by expert, ~100 scalar `t_g` calls and a `t_g_group` call per resident group a
    plan): the same values, element by element, as those calls compute."""
    parts = state.__dict__.get("_horizon_parts")
    if parts is None:
        cost = state.cost
        times = layer_expert_times(state)  # shared with HSS, DALI's list and PreSched's walk
        in_group = (cost.count_times(state.tokens)[2] if is_counts(state.tokens)
                    else cost.t_g_shares(state.tokens.astype(np.float64))).tolist()
        landing = {t.expert: t.remaining_s for t in state.inflight if t.layer == state.layer}
        parts = state.__dict__["_horizon_parts"] = LayerParts(landing, cost.t_shared(state.batch_tokens), {},
                                                              times.tokens, times.gpu, in_group)
    return parts


def group_time(state: LayerState, experts: tuple[int, ...]) -> float:
    """GPU seconds of `experts` (in this order) run in one device call: `sum(cost.t_g_group(tokens))`, remembered per
    layer state (most candidate splits run the same resident experts). The same sum of the same float64 array as
    `t_g_group` builds: each expert's share, the call's dispatch added to the first with tokens."""
    parts = layer_parts(state)
    groups = parts.groups
    if experts not in groups:
        each = [parts.in_group[e] for e in experts]
        groups[experts] = float(state.cost.with_dispatch(each, [parts.tokens[e] for e in experts]).sum()) \
            if experts else 0.0
    return groups[experts]


def candidate_splits(state: LayerState, names: Sequence[str], may_move_resident: bool) -> list[Split]:
    """The candidate splits of `names` other than PreSched's (which comes from its plan)."""
    tok, cost = state.tokens, state.cost
    ready, missing = split_by_availability(state)
    tokens = layer_parts(state).tokens
    cur = sorted(missing.tolist(), key=tokens.__getitem__)  # ascending (stable: ties by id, as `by_tokens`)
    ready_t = tuple(ready.tolist())
    out: list[Split] = []
    for name in names:
        if name == "greedy":
            ready_s = cost.t_shared(state.batch_tokens) + group_time(state, ready_t) if ready.size \
                else cost.t_shared(state.batch_tokens)
            t_g = float(cost.t_g(max(max(tokens, default=1), 1)))
            t_c = layer_expert_times(state).cpu
            i = greedy_split([float(tokens[e]) for e in cur], ready_s, state.alpha_s, state.t_io_s, t_g, cost,
                             [t_c[e] for e in cur])
            loads = tuple(cur[i:][::-1])
            out.append(Split(name, tuple(cur[:i]), ready_t + loads, loads))
        elif name == "hss" and may_move_resident:
            cpu, gpu = hybrid_scheduling(ready, missing, tok, state.t_io_s, cost, state.alpha_s,
                                         layer_expert_times(state))
            miss = set(missing.tolist())
            loads = tuple(e for e in gpu if e in miss)
            out.append(Split(name, tuple(cpu), tuple(e for e in gpu if e not in miss) + loads, loads))
        elif name == "dali":
            out.append(list_split(state, may_move_resident))
        elif name == "all_cpu":
            out.append(Split(name, tuple(cur), ready_t, ()))
        elif name == "all_gpu":
            loads = tuple(cur[::-1])
            out.append(Split(name, (), ready_t + loads, loads))
    return out


def list_split(state: LayerState, may_move_resident: bool) -> Split:
    """DALI's greedy 0-1 assignment as a candidate: the layer's experts hottest first, each to the side that finishes
    it first (the GPU after its transfer where it is missing), each expert its own device call. Where many small
    experts each carry a few tokens (DeepSeek-V2-Lite, Moonlight at batch 4-8) this per-expert balance beats the
    splits above, which cut one sorted list of the missing experts."""
    cpu, gpu, loads, _ = greedy_assignment(state, may_move_resident)
    landing = set(loads)
    return Split("dali", tuple(cpu), tuple(e for e in gpu if e not in landing) + tuple(loads), tuple(loads))


@dataclass(frozen=True)
class NextLayer:
    """Layer l+1 as its forecast shows it at layer l's plan: its predicted experts neither resident nor landing
    (ascending predicted tokens: the coldest are the CPU's, the hottest the prefetches'), the CPU time of the coldest
    j of them for every j, each one's GPU time, and the shared + resident predicted experts' one device call."""

    layer: int
    experts: tuple[int, ...]
    cpu_prefix: np.ndarray  # float64 [n + 1]: t_c_sum of the coldest j, j = 0..n
    gpu_each: np.ndarray  # float64 [n]
    ready_s: float


def next_layer(state: LayerState, e_next: Optional[tuple[Sequence[int], Sequence[float]]] = None
               ) -> Optional[NextLayer]:
    """Layer l+1 from its forecast (`LayerState.predicted`, the predictor PreSched reads); None at the last layer or
    without a forecast. `e_next`: PreSched's E_next of l+1 (`Lookahead.candidates`: the predicted experts neither
    resident nor landing, ascending predicted tokens, ties lower id first) where its plan built it already."""
    target = state.layer + 1
    if target >= state.num_layers or target not in state.predicted:
        return None
    cost = state.cost
    pred = state.predicted[target]
    some = np.flatnonzero(pred > 0)
    avail = state.available(target)[some]
    if e_next is None:
        missing = some[~avail]
        order = missing[np.argsort(pred[missing], kind="stable")]  # ties: lower id first, as PreSched's E_next
        experts, m = tuple(order.tolist()), pred[order].tolist()
    else:
        experts, m = tuple(e_next[0]), list(e_next[1])
    ready = pred[some[avail]]
    # `sum(t_g_group(ready))`, the dispatch placed on a list (the same array summed)
    ready_s = cost.t_shared(state.batch_tokens) + \
        (float(cost.with_dispatch(cost.t_g_shares(ready), ready.tolist()).sum()) if ready.size else 0.0)
    # each expert's `t_g`: on Python floats for a few (the scalar and array paths give the same values)
    gpu_each = np.array([cost.t_g(x) for x in m], dtype=np.float64) if len(m) <= _QUEUE_NUMPY_FROM \
        else np.atleast_1d(cost.t_g(np.asarray(m, dtype=np.float64)))
    return NextLayer(target, experts, np.concatenate([[0.0], cost.t_c_prefix(m)]), gpu_each, ready_s)


def next_layer_times(state: LayerState, nxt: NextLayer, owed: np.ndarray, counts: int) -> np.ndarray:
    """float64 [S, K]: seconds from layer l+1's gate until it is done, as `layer_time` plays it, when its k hottest
    missing experts come from this plan's prefetches (k = 0..K-1, K = min(counts, |E_next|) + 1) and the link owes
    max(owed + k t_io, 0) at its gate (`owed` float64 [S]: one per candidate split; the prefetches included): the best
    of its coldest j on the CPU and the rest loaded behind that, hottest first, for every j. Every split and count in
    one array pass ([S, K, j]); each (split, count) is computed with the same float operations, in the same order, as
    one count at a time would (the reversed running sums over a count's missing experts are one row's cumsum behind
    leading zeros), so the plans do not change."""
    t_io = state.t_io_s
    total = len(nxt.experts)
    ks = np.arange(min(total, counts) + 1)
    alpha = np.maximum(owed[:, None] + ks * t_io, 0.0)[:, :, None]  # [S, K, 1]
    n = total - ks  # the coldest n stay missing
    landed = np.array([0.0] + [float(nxt.gpu_each[total - k:].sum()) for k in ks[1:]])  # the prefetched ones' GPU time
    # the prefetched experts land by alpha at the latest
    gpu = np.where(ks[:, None] > 0, np.maximum(nxt.ready_s, alpha) + landed[:, None], nxt.ready_s)  # [S, K, 1]
    each = nxt.gpu_each
    rows = np.zeros((ks.size, total))
    for k in ks.tolist():
        rows[k, k:] = each[:total - k][::-1]
    tail = np.concatenate([np.cumsum(rows, axis=1)[:, ::-1], np.zeros((ks.size, 1))], axis=1)  # [K, total + 1]
    j = np.arange(total + 1)
    loads = n[:, None] - j  # [K, total + 1]: loaded experts when the coldest j run on the CPU
    last = np.where(j < n[:, None], np.append(each, 0.0), 0.0)  # the last load (the coldest loaded) on landing
    g = np.where(loads > 0, np.maximum(gpu + tail, alpha + loads * t_io + last), gpu)  # [S, K, total + 1]
    cpu = nxt.cpu_prefix
    s = state.cost.device_cpu_share
    t = np.maximum(cpu + s * g, g + s * cpu) if s > 0 else np.maximum(cpu, g)
    return np.where(loads >= 0, t, np.inf).min(axis=2)


def split_times(state: LayerState, splits: Sequence[Split]) -> list[float]:
    """`layer_time` of every split, played once per distinct (cpu, gpu, loads): the candidates often coincide (eq. 4's
    split and eq. 1's, HSS and DALI's list, all loaded and eq. 1's on a short link; 1,527 distinct of 2,880 at
    Mixtral b1, 4,295 of 4,320 at Qwen3 b64, `bench_planning.py`'s points)."""
    played: dict[tuple, float] = {}
    out = []
    for split in splits:
        key = (split.cpu, split.gpu, split.loads)
        if key not in played:
            played[key] = layer_time(state, split)
        out.append(played[key])
    return out


def search(state: LayerState, splits: Sequence[Split], nxt: Optional[NextLayer], counts: int, baseline: int = 0
           ) -> tuple[Split, Optional[int], float]:
    """The split, and how many of the next layer's hottest forecast experts to prefetch (None: PreSched's own
    prefetches), that end this layer and the next soonest: `layer_time` of the split plus `next_layer_times` with the
    link time its loads and the prefetches leave owed at the next gate. Without a forecast of the next layer (or none
    of its experts missing) the fastest split alone (first minimum: PreSched's split keeps ties). Third: the seconds the
    choice saves by the same estimate against the first split (PreSched's) with `baseline` prefetches (its own count
    of the next layer's hottest, up to `counts`)."""
    if nxt is None or not nxt.experts or counts <= 0:
        times = split_times(state, splits)
        first = min(range(len(splits)), key=times.__getitem__)
        return splits[first], None, times[0] - times[first]
    t_io = state.t_io_s
    t = np.array(split_times(state, splits))
    owed = state.alpha_s + np.array([len(split.loads) for split in splits]) * t_io - t - state.t_attn_next_s
    # [split, k]: every split's two-layer time per prefetch count, in one array pass
    totals = (t[:, None] + next_layer_times(state, nxt, owed, counts)).tolist()
    best, best_t = (splits[0], 0), math.inf
    for split, row in zip(splits, totals):
        for k, total in enumerate(row):
            if total < best_t - 1e-12:  # strictly better: fewer prefetches and PreSched's split keep ties
                best, best_t = (split, k), total
    return best[0], best[1], totals[0][min(baseline, len(totals[0]) - 1)] - best_t


class Recent:
    """The last `size` values with their running sum and a sorted copy: their mean and median without a pass over
    them (both are read at every decode plan whose search has a price)."""

    def __init__(self, size: int, median: bool = True):
        self.values: deque[float] = deque(maxlen=size)  # oldest first
        self.ordered: Optional[list[float]] = [] if median else None  # the values in order (for `median` only)
        self.total = 0.0

    def __len__(self) -> int:
        return len(self.values)

    def add(self, value: float) -> None:
        ordered = self.ordered
        if len(self.values) == self.values.maxlen:
            oldest = self.values[0]
            self.total -= oldest
            if ordered is not None:
                del ordered[bisect_left(ordered, oldest)]
        self.values.append(value)
        self.total += value
        if ordered is not None:
            insort(ordered, value)

    def mean(self) -> float:
        return self.total / len(self.values)

    def median(self) -> float:
        """As `statistics.median`: the middle value, or the mean of the two middle ones."""
        s = self.ordered
        assert s is not None, "Recent(median=False) keeps no order"
        n = len(s)
        return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


TIME_EVERY = 4  # a priced Horizon times one decode search in this many on the run's clock


@register("horizon", settings=HorizonSettings)
class Horizon(PreSched):
    """See the module docstring."""

    def __init__(self, settings: HorizonSettings, setup: SchedulerSetup):
        super().__init__(settings, setup)
        # batch tokens -> what the last `saving_window` searched decode plans saved by the cost model's estimate (s)
        self.savings: dict[int, Recent] = {}
        self.plans_since_search = [0] * self.L
        self.probe_every = [settings.search_probe] * self.L  # per layer: plans between probes (`search_probe_max`)
        self.probing = False  # the current plan searches only because its layer is due a probe
        # batch tokens -> seconds of the last `search_window` timed decode searches on the run's clock, and the price
        # they make (`search_price`)
        self.search_times: dict[int, Recent] = {}
        self.prices: dict[int, float] = {}
        self.searches = 0  # decode searches with a clock to time them on (every `TIME_EVERY`-th is timed)
        fixed = settings.search_cost_us
        # whether the search has a price to weigh: a fixed `search_cost_us` > 0, or (None) a run that charges plans
        self.priced = fixed > 0 if fixed is not None else not setup.planning.free
        # float64 [next_step_layers, E]: this decode step's tokens per expert at the first MoE layers (the cross-step
        # forecast), and the layers of it seen this step
        self.step_tokens = np.zeros((min(settings.next_step_layers, self.L), setup.num_experts))
        self.step_seen = np.zeros(self.step_tokens.shape[0], dtype=bool)

    def plan(self, state: LayerState) -> LayerPlan:
        """PreSched's plan through `finish` (the split and prefetches chosen), then the prefetches across the step
        boundary where `next_step_layers` asks for them."""
        if state.layer < self.step_tokens.shape[0]:
            self.remember_step(state)
        return self.next_step_prefetch(state, super().plan(state))

    def remember_step(self, state: LayerState) -> None:
        """This pass's routing at one of the first MoE layers (a decode step's; a prefill pass's is forgotten)."""
        layer = state.layer
        decode = state.phase is Phase.decode
        self.step_tokens[layer] = state.tokens if decode else 0.0
        self.step_seen[layer] = decode

    def next_step_prefetch(self, state: LayerState, plan: LayerPlan) -> LayerPlan:
        """`plan` with prefetches for the next decode step's first MoE layers, at this step's last MoE layer.

        No forecast reaches past a step (the predictors run inside a pass), so without this the first layers of every
        step start with what the cache happens to hold and load the rest after their gate. What is known at the last
        layer: the routing these sequences took at the first layers this step; the next token of each sequence tends
        to the same experts (temporal locality), and a hot expert stays hot. The candidates are the experts routed
        there this step, not available, most tokens first (ties: higher usage, lower id); as many as the link's idle
        time before the next step's first gate holds (this layer's estimated end plus one attention block, less what
        the link owes after this plan's transfers: the dense layers and the head are left out, so the estimate
        errs short), each taking a free slot or the slot of the cached expert the eviction key puts first, and only
        while it is needed sooner than that expert (usage per layer until its layer comes back, as `admitted`).
        A transfer that has not started at the next gate is dropped by that plan, one that has runs on."""
        targets = self.step_tokens.shape[0]
        L = state.num_layers
        if not targets or state.phase is not Phase.decode or state.layer != L - 1 or state.cost.link_cpu_share > 0 \
                or not self.step_seen.all() or plan.speculate is not None:
            return plan
        t_io = state.t_io_s
        owed = state.alpha_s + t_io * (len(plan.ondemand) + len(plan.prefetch) + len(plan.hold))
        idle = plan_time(state, plan) + state.t_attn_next_s - owed
        count = int(idle // t_io) if idle > 0 else 0
        if count <= 0:
            return plan
        wanted: list[tuple[int, int]] = []
        for target in range(targets):
            routed = np.flatnonzero(self.step_tokens[target] > 0)
            routed = routed[~state.available(target)[routed]]
            if routed.size:
                usage = self.standing(np.full(routed.size, target), routed)
                order = np.lexsort((routed, -usage, -self.step_tokens[target][routed]))
                wanted += [(target, int(e)) for e in routed[order]]
        wanted = wanted[:count]
        if not wanted:
            return plan
        free = max(state.free_slots, 0) + len(plan.evict) - sum(plan.retain) - len(plan.prefetch) - len(plan.hold)
        free = max(free, 0)
        protect = {(state.layer, e) for e in plan.gpu} | set(plan.evict) | set(plan.prefetch) | set(plan.hold)
        victims = self.victims(state, len(wanted) - free, protect)
        if victims:  # keep an incoming expert only where it is needed sooner than the victim it displaces
            layers, experts = np.array(wanted, dtype=np.int64).T
            incoming = self.next_use_key(state, layers, experts).tolist()
            outgoing = self.next_use_key(state, *np.array(victims, dtype=np.int64).T).tolist()
            granted = free
            for new, old in zip(incoming[free:], outgoing):
                if new <= old:
                    break
                granted += 1
            wanted, victims = wanted[:granted], victims[:granted - free]
        else:
            wanted = wanted[:free]
        if not wanted:
            return plan
        for target, e in wanted:  # keep them away from the eviction end until their layer runs
            self.last_used[target, e] = self._clock
        return replace(plan, prefetch=plan.prefetch + tuple(wanted), evict=plan.evict + tuple(victims))

    @property
    def micro_batches(self) -> int:
        return max(1, self.settings.micro_batches)

    def finish(self, state: LayerState, cpu: tuple[int, ...], gpu: tuple[int, ...], loads: tuple[int, ...],
               prefetch: list[tuple[int, int]], keep_working_set: bool, ahead: Optional[Lookahead] = None
               ) -> LayerPlan:
        """PreSched's split and prefetches (its bookkeeping already done) -> the chosen split and prefetches, with
        the cache slots for them."""
        self.searched = self.probing = False
        names = [n for n in self.settings.candidates if n != "presched"]
        if state.phase is Phase.prefill and "presched" in self.settings.candidates \
                and not self.settings.prefill_candidates:
            return self.plan_with_slots(state, cpu, gpu, loads, prefetch, keep_working_set)
        if state.phase is Phase.decode and self.skips_search(state, Split("presched", cpu, gpu, loads)):
            return self.plan_with_slots(state, cpu, gpu, loads, self.presched_prefetch(state, ahead, prefetch),
                                        keep_working_set)
        self.searched = bool(names) or self.settings.prefetch_counts > 0  # anything to search beyond PreSched's plan
        # the search's own time on the run's clock: what skipping it saves the run (decode: the plans it may skip).
        # Every TIME_EVERY-th search only: reading a thread CPU clock is a system call, tens of µs on a loaded host
        clock = self.setup.planning.clock if state.phase is Phase.decode and self.settings.search_cost_us is None \
            else None
        if clock is not None:
            self.searches += 1
            if self.searches % TIME_EVERY != 1:
                clock = None
        begin = clock() if clock is not None else 0.0
        splits = candidate_splits(state, names, not self.resident_on_device)
        if "presched" in self.settings.candidates:
            splits.insert(0, Split("presched", cpu, gpu, loads))
        if state.phase is Phase.prefill:
            return self.prefill_plan(state, splits, gpu, prefetch, keep_working_set)
        # the two-layer estimate plays a DMA link; where a copy takes host cores (`link_cpu_share`, the CPU backend)
        # PreSched's prefetch rules, which charge the copies to the CPU side, stay
        sized = self.settings.use_predictor and self.settings.prefetch_counts > 0 and state.cost.link_cpu_share <= 0
        e_next = ahead.candidates(state.layer + 1) if sized and ahead is not None and ahead.forecast(state.layer + 1) \
            else None  # PreSched's E_next of l+1, built by its plan or now (one build either way)
        nxt = next_layer(state, e_next) if sized else None
        # PreSched's count of l+1's prefetches: only what a priced search weighs its saving against
        baseline = presched_next_count(self, state, ahead) if self.priced and nxt is not None else 0
        best, count, saved = search(state, splits, nxt, self.settings.prefetch_counts, baseline)
        if self.priced and "presched" in self.settings.candidates:
            self.record_saving(state, saved)
        if count is not None:
            assert nxt is not None
            prefetch = [(nxt.layer, e) for e in nxt.experts[::-1][:count]]  # hottest first
        if best.gpu != gpu:
            self.touch(state.layer, best.gpu)
        if clock is not None:
            self.record_search_time(state.batch_tokens, clock() - begin)
        if count is None:  # no sized count of l+1: PreSched's prefetches (Q4's later targets) run
            prefetch = self.presched_prefetch(state, ahead, prefetch)
        return self.plan_with_slots(state, best.cpu, best.gpu, best.loads, prefetch, keep_working_set)

    def _decode_prefetch(self, state: LayerState, ahead: Lookahead, gap: float) -> list[tuple[int, int]]:
        """Deferred to `finish`: PreSched's decode prefetches (eqs. 5-6 and Q4) are made only where the plan runs them
        (`presched_prefetch`: a plan that skips the search, or a search without a sized count of l+1). A searched
        plan chooses its own count of l+1's hottest forecast experts, so PreSched's list, and the forecasts of l+2 and
        l+3 its Q4 window reads when l+1 has nothing for the GPU, were made for nothing (Qwen3-30B b1: 2.8 forecasts
        and queues a plan). Forecasts not made are not scored (`LayerState.predicted`), as anywhere else: the hit
        rates of distances 2-3 come from the forecasts PreSched's prefetches read."""
        return []

    def presched_prefetch(self, state: LayerState, ahead: Optional[Lookahead], made: list[tuple[int, int]]
                          ) -> list[tuple[int, int]]:
        """PreSched's decode prefetches of this plan (`made`: what its plan passed, empty while deferred)."""
        if ahead is None or state.phase is not Phase.decode:
            return made
        return PreSched._decode_prefetch(self, state, ahead, ahead.gap)

    def search_price(self, state: LayerState) -> float:
        """Seconds a decode search costs the run now (`search_cost_us`): the fixed figure, or the run's price: its fixed
        price of a search plus the median of the last searches at this batch on its clock (0 before the first)."""
        if self.settings.search_cost_us is not None:
            return self.settings.search_cost_us * 1e-6
        return self.prices.get(state.batch_tokens, self.setup.planning.search_s)

    def record_search_time(self, batch_tokens: int, seconds: float) -> None:
        """One decode search's time on the run's clock, kept among the last `search_window` timed at this batch."""
        seen = self.search_times.setdefault(batch_tokens, Recent(self.settings.search_window))
        seen.add(seconds)
        self.prices[batch_tokens] = self.setup.planning.search_s + seen.median()

    def skips_search(self, state: LayerState, presched: Split) -> bool:
        """Whether this decode plan keeps PreSched's split unsearched: a search that weighs this layer alone where
        PreSched's split ends sooner than the search's price, or one whose recent searches at this batch saved less
        than it on average (every layer's plans: a layer's savings come in bursts, a saving of milliseconds among
        plans that save nothing, so its own last few say little of its next); every `search_probe`-th plan of a layer
        searches anyway."""
        if not self.priced:
            return False
        budget = self.search_price(state)
        if budget <= 0:
            return False
        if not self.looks_ahead(state) and layer_time(state, presched) < budget:
            return True  # all the search can shorten is this layer, which ends sooner than the search does
        layer = state.layer
        self.plans_since_search[layer] += 1
        seen = self.savings.get(state.batch_tokens)
        # a pass of searches first: a few plans' savings (often none, then milliseconds) say little of the mean
        self.probing = seen is not None and len(seen) >= min(self.L, self.settings.saving_window) \
            and seen.mean() < budget
        return self.probing and self.plans_since_search[layer] < self.probe_every[layer]

    def looks_ahead(self, state: LayerState) -> bool:
        """Whether this decode plan's search weighs the next layer too (then it may save more than this layer lasts)."""
        settings = self.settings
        return settings.use_predictor and settings.prefetch_counts > 0 and state.cost.link_cpu_share <= 0 \
            and state.layer + 1 < state.num_layers and state.layer + 1 in state.predicted

    def record_saving(self, state: LayerState, seconds: float) -> None:
        """A searched decode plan of `state.layer` and what it saved by the cost model, among the last
        `saving_window` at this batch; a probe that leaves their mean below the search's price doubles the layer's
        probe interval, one above it sets it back."""
        seen = self.savings.setdefault(state.batch_tokens, Recent(self.settings.saving_window, median=False))
        seen.add(seconds)
        layer = state.layer
        self.plans_since_search[layer] = 0
        if seen.mean() >= self.search_price(state):
            self.probe_every[layer] = self.settings.search_probe
        elif self.probing:
            self.probe_every[layer] = min(2 * self.probe_every[layer], self.settings.search_probe_max)

    def prefill_plan(self, state: LayerState, splits: Sequence[Split], presched_gpu: tuple[int, ...],
                     prefetch: list[tuple[int, int]], keep_working_set: bool) -> LayerPlan:
        """A prefill pass: the fastest candidate split (`layer_time`; ties keep PreSched's), with PreSched's prefill
        prefetches. PreSched's eq. 1 split keeps every resident expert on the GPU; with hundreds of tokens per expert
        moving some to the CPU while the missing ones load (HSS, DALI's list) ends the layer sooner: Qwen3-30B A100
        b4, seed 0, one batch in flight, prefill 6.97 -> 5.54 s (DALI's own 5.80)."""
        best = min(splits, key=lambda split: layer_time(state, split))
        if best.gpu != presched_gpu:
            self.touch(state.layer, best.gpu)
        return self.plan_with_slots(state, best.cpu, best.gpu, best.loads, prefetch, keep_working_set)

    def plan_with_slots(self, state: LayerState, cpu: tuple[int, ...], gpu: tuple[int, ...], loads: tuple[int, ...],
                        prefetch: list[tuple[int, int]], keep_working_set: bool = False) -> LayerPlan:
        """The cache's plan (`OffloadPolicy.plan_with_slots`), then, with `admit_loads` and next-use eviction, the
        kept loads admitted by `admitted`."""
        plan = super().plan_with_slots(state, cpu, gpu, loads, prefetch, keep_working_set)
        if not (self.settings.admit_loads and self.settings.evict_next_use and any(plan.retain)):
            return plan
        return self.admitted(state, plan)

    def admitted(self, state: LayerState, plan: LayerPlan) -> LayerPlan:
        """`plan` keeping a load only where it beats the victim it displaces by the eviction key (usage per layer
        until the next use; a load of this layer is next used a whole pass later): the coldest kept load against
        the last victim, repeatedly. A kept load that displaces an expert needed sooner costs that expert's miss in
        a layer or two for a hit a pass away (DeepSeek-V2-Lite b64: 0.07 loads a layer kept, each evicting one of
        the next layers' experts, 1.187 s a step against 1.184 without keeping any; yet at 60 % of the experts
        cached keeping every load is worth 1.2 %)."""
        kept = [i for i, r in enumerate(plan.retain) if r]
        evict = list(plan.evict)
        retain = list(plan.retain)
        if not evict:
            return plan
        # every key the walk may compare, in one call each (elementwise: the values one call per key gives)
        loads = self.next_use_key(state, np.full(len(kept), state.layer), np.array([plan.ondemand[i] for i in kept],
                                                                                   dtype=np.int64)).tolist()
        victims = self.next_use_key(state, *np.array(evict, dtype=np.int64).T).tolist()
        while kept and evict:
            if loads[len(kept) - 1] > victims[len(evict) - 1]:
                break
            retain[kept.pop()] = False
            evict.pop()
        return replace(plan, retain=tuple(retain), evict=tuple(evict))

    def next_use_key(self, state: LayerState, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """float64 [n]: usage (PreSched's token share) per layer until the expert's layer comes back (a whole pass
        for this layer's): the lower, the sooner it goes."""
        return self.standing(layers, experts) / self.layers_until_back(state.layer, state.num_layers)[layers]

    def layers_until_back(self, layer: int, L: int) -> np.ndarray:
        """float64 [L]: per layer, how many layers until it runs again after `layer` (L for `layer` itself), made once
        per layer (the integers `next_use_key` divides by, as float64: the same quotients)."""
        table = self.__dict__.setdefault("_until_back", {})
        if (layer, L) not in table:
            comes_back = (np.arange(L) - layer) % L
            table[layer, L] = np.where(comes_back == 0, L, comes_back).astype(np.float64)
        return table[layer, L]

    def eviction_order(self, state: LayerState, layers: np.ndarray, experts: np.ndarray, need: int) -> np.ndarray:
        """Next use first (`evict_next_use`): a pass runs the layers in order, so a cached expert of the layer that
        comes back last is needed last (this layer's, then the previous one's, ...; the next layer's soonest). The victim
        is the lowest usage (PreSched's token share, never below the profile's) per layer until its layer comes
        back, then least recently used: with every expert routed each pass (usage alike) the one whose layer comes
        back last (Belady's rule on the layer cycle: the miss the link has the most layers to bring back), while a
        cold expert still goes before a hot one of a layer a little further away."""
        if not self.settings.evict_next_use:
            return super().eviction_order(state, layers, experts, need)
        key = self.next_use_key(state, layers, experts)
        if need < key.size:  # sort only what can be chosen (as PreSched's order): keys up to the need-th smallest
            some = np.flatnonzero(key <= np.partition(key, need - 1)[need - 1])
            return some[np.lexsort((self.last_used[layers[some], experts[some]], key[some]))][:need]
        return np.lexsort((self.last_used[layers, experts], key))


def presched_next_count(policy: PreSched, state: LayerState, ahead: Optional[Lookahead]) -> int:
    """How many of layer l+1's experts PreSched's decode prefetches (`PreSched._decode_prefetch`) would take: its
    count at distance 1 where l+1's cross-layer queue holds an expert of l+1, else 0 (its Q4 window moves on, to
    later layers); the same number as counting the targets of its list, without the forecasts of l+2 and l+3."""
    if ahead is None or state.layer + 1 >= state.num_layers or not policy._window():
        return 0
    share = state.cost.link_cpu_share
    if share > 0:  # PreSched's host-copy rules filter the list: count it
        return sum(1 for target, _ in PreSched._decode_prefetch(policy, state, ahead, ahead.gap)
                   if target == state.layer + 1)
    _, counts = policy._prefetch_counts(state, ahead.gap)
    if not counts[0] or not ahead.forecast(state.layer + 1) or not ahead.has_next(state.layer + 1):
        return 0
    return min(counts[0], len(ahead.candidates(state.layer + 1)[0]))


def plan_time(state: LayerState, plan: LayerPlan) -> float:
    """`layer_time` of a plan (tests and the study compare policies' splits with it)."""
    return layer_time(state, Split("plan", plan.cpu, plan.gpu, plan.ondemand), sorted(plan.held_here(state.layer)))


__all__ = ["Horizon", "HorizonSettings", "NextLayer", "Split", "candidate_splits", "layer_time", "next_layer",
           "next_layer_times", "plan_time", "search"]
