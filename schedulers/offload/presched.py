"""PreSched: LayerScope's prefetch-aware cross-layer scheduler (§4.3, Algorithm 1).

At layer l, after its gate, with alpha the link time still owed to a started prefetch:

1. **Cross-layer queue** (Premise 1, eq. 3). E_cur: the layer's active experts that are neither
   resident nor landing, ascending by tokens; E_next: the predicted experts of layer l+1 likewise
   (predicted tokens). E_all merges both ascending (ties: next-layer expert first). For each k,
   T^G_all(k) = alpha + (|E_all| - k) t_io + t_g and T^C_all(k) = t_c(E_all[0..k]) + t_attn
   (a CPU side of several experts pays the cost model's per-layer hand-over once, `t_c_prefix`);
   E_all[k] joins GPU_Q when T^G_all(k) < T^C_all(k).
2. **On-demand loop** (Premise 2, eq. 4). Walking GPU_Q from its coldest entry, the first
   current-layer expert E_cur[i'] with T_G(i') = alpha + (n - i' + 1) t_io + t_g <
   T_C(i') = t_c(E_cur[0..i'-1]) fixes i = i': E_cur[i..n] are loaded on demand, E_cur[0..i-1]
   run on the CPU. No passing entry: nothing is loaded. (Algorithm 1 line 3 initialises i = n,
   which read literally would always load E_cur[n]; eq. 4 and Premise 2 say a load happens only
   when it beats the CPU, so we start from "no load".)
3. **Prefetch count** (eq. 5): T_gap = t_c(E_cur[0..i-1]) - alpha - (n - i + 1) t_io,
   f = (T_gap + t_attn) / t_io, |f| = round(f) (halves up).
4. **Critical prefetch** (eq. 6): xi = R_hit (f - |f| + 1) t_io - R_miss (|f| - f) t_io with the
   predictor's measured hit rate; xi > 0 keeps |f| prefetches, otherwise |f| - 1. The hottest
   |f| experts of E_next are prefetched, hottest first (§4.3.3 Q3: "executing the highest-priority
   prefetch first").
5. **Q4**: when GPU_Q holds no expert of E_next (the next layer's experts all belong on the CPU),
   the window moves to l+2, l+3, ... (up to `max_window`) under the same gap and trade-off.

The plan sits on the executor's critical path, so it reads a forecast (`LayerState.predicted` runs
the predictor on first access) only where the forecast can change it: layer l+1's GPU_Q when some
i' passes eq. 4, and a target of the window while a prefetch count is left for it or a further one
(steps 3-5 need no forecast, and no forecast makes a prefetch out of a count of 0). Forecasts not
read are not made, so they are not scored either (R_hit and online fine-tuning see the ones used).

Prefetches are non-interruptible and the link is serial (Premises 3-4: the mechanism's contract);
prefetches land in the cache's replaceable slots. The paper keeps the hot table fixed and rotates
prefetch buffers; `conf/scheduler/presched.yaml` goes further: the hot table only starts the cache
(`pin_hot_table: false`), on-demand loads are cached too (`retain_loads`), and what makes room goes
lowest moving-average token share first (`eviction: token_share`, `OffloadPolicy.observe_usage`;
the first MoE layer's experts, which no prefetch reaches, only for that layer's own loads), so the
cache follows a hot set that drifts over the decode steps (with the paper's pinned table,
HybriMoE's score-aware per-layer cache beat PreSched by up to 2% at batches 16-64 of the synthetic
routing).

Loads on the GPU side: eqs. 3-5 charge t_io per on-demand load because Premise 5 takes the GPU's
work as negligible next to a transfer. Each loaded expert is a device call of its own, so where a
call costs more than a transfer (small experts, a host-driven device such as this CPU backend) the
calls, not the link, pace the loads; the terms use max(t_io, t_g), which is t_io on every paper
profile. Prefetch counting (eq. 5's f, eq. 6) stays in link time.

Prefill passes: eq. 4's strict T_G(i') < T_C(i') can never hold at i' = 0 (no CPU expert, T_C = 0),
so read literally it always leaves the coldest missing expert on the CPU. At decode sizes that costs
at most one expert's CPU time; in a prefill pass (hundreds of tokens per hot expert, eq. 2's CPU
time far above a transfer) it would dominate the pass. The cost model of §4.3 (Premise 5,
token-invariant GPU/PCIe cost) is built for decode, so a prefill pass takes the per-layer optimum of
eq. 1 (the missing experts split to minimise max(T_C, T_G), GPU work counted), and prefetches every
predicted expert of the next layer that is worth a transfer there (t_c above t_io), hottest first:
in a prefill nearly every such expert is active, so a prefetch replaces an on-demand load of the
same expert (eq. 6 with R_miss -> 0).

Host-copied links (`cost.link_cpu_share` > 0, the CPU backend): a copy also takes CPU time, which
the paper's DMA links never do. An i' of eq. 4 then also has to end the layer before the all-CPU
split with share * t_io per load on the CPU side (`loads_pay_for_host_copies`), and only
experts whose CPU run outlasts their copy are prefetched. Where the device is the host itself
(`cost.device_cpu_share`, 1 on the CPU backend), a loaded expert's device call also counts on the
CPU side, and `offload_resident` is off: a resident expert moved to the CPU would take the cores
the device runs on. With both shares 0 (every GPU profile) the plan is Algorithm 1's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import itemgetter
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np

from schedulers.base import LayerPlan, LayerState, Phase, SchedulerSettings, register
from schedulers.cost import CostModel
from schedulers.offload.layerwise import greedy_split
from schedulers.policy import OffloadPolicy, layer_expert_times, split_by_availability


_NUMPY_FROM = 24  # eq. 3 / eq. 4 over more experts than this run elementwise in numpy (same values, fewer Python steps)


def gpu_times(cost: CostModel, ms: Sequence[int]) -> list[float]:
    """`[cost.t_g(m) for m in ms]` (each expert in a call of its own): elementwise in numpy for many experts, the
    same values (`t_g` computes each one alike on scalars and arrays)."""
    if len(ms) > _NUMPY_FROM:
        return np.atleast_1d(cost.t_g(np.asarray(ms, dtype=np.float64))).tolist()
    return [cost.t_g(m) for m in ms]


def sorted_by(experts: Sequence[int], key: Sequence[float]) -> list[int]:
    """`experts` ascending by `key[e]` (stable: ties keep the given order), as `policy.by_tokens`."""
    return sorted(experts, key=key.__getitem__)


class CrossLayerQueue(NamedTuple):
    """Eq. 3 over E_all: which entries join the GPU queue (all tuples in E_all order). A named tuple: built up to
    four times a decode plan (a frozen dataclass's `__init__` cost a microsecond more each)."""

    experts: tuple[int, ...]  # E_all, ascending tokens
    tokens: tuple[float, ...]
    is_current: tuple[bool, ...]
    in_gpu_queue: tuple[bool, ...]

    @property
    def has_next(self) -> bool:
        """GPU_Q holds an expert of the prefetch layer."""
        return any(q and not c for q, c in zip(self.in_gpu_queue, self.is_current))

    @property
    def gpu_queue(self) -> list[int]:
        """GPU_Q: the experts of E_all that joined it, coldest first."""
        return [e for e, q in zip(self.experts, self.in_gpu_queue) if q]

    def current_outside(self) -> int:
        """How many current-layer experts stay out of GPU_Q."""
        return sum(1 for q, c in zip(self.in_gpu_queue, self.is_current) if c and not q)


def cross_layer_queue(cur: Sequence[int], cur_tokens: Sequence[float], nxt: Sequence[int], nxt_tokens: Sequence[float],
                      alpha: float, t_io: float, t_g: float, t_attn: float, cost: CostModel,
                      gpu_busy: float = 0.0) -> CrossLayerQueue:
    """Eq. 3. `cur`, `nxt`: expert ids (any order) with their (predicted) token counts."""
    entries = [(float(m), True, int(e)) for e, m in zip(cur, cur_tokens)]
    entries += [(float(m), False, int(e)) for e, m in zip(nxt, nxt_tokens)]
    entries.sort(key=itemgetter(0, 1))  # ascending tokens; ties: next-layer expert first (stable)
    n_all = len(entries)
    tokens, current, experts = zip(*entries) if entries else ((), (), ())
    t_cpu = cost.t_c_prefix(tokens)  # the CPU side's hand-over counted once
    if n_all > _NUMPY_FROM:  # the same comparisons elementwise (a layer of many small experts)
        k = np.arange(n_all)
        joins = tuple((np.maximum(alpha + (n_all - k) * t_io, gpu_busy) + t_g < np.asarray(t_cpu) + t_attn).tolist())
    else:  # max(link, gpu_busy) without its call (the same value): this runs for up to four targets a plan
        out = []
        for k in range(n_all):
            link = alpha + (n_all - k) * t_io
            out.append((gpu_busy if gpu_busy > link else link) + t_g < t_cpu[k] + t_attn)
        joins = tuple(out)
    return CrossLayerQueue(experts, tokens, current, joins)


def ondemand_passes(cur_tokens_sorted: Sequence[float], alpha: float, t_io: float, t_g: float, cost: CostModel,
                    gpu_busy: float = 0.0) -> list[bool]:
    """Eq. 4 at every i' of E_cur (ascending): T_G(i') < T_C(i') = t_c(E_cur[0..i'-1])."""
    n1 = len(cur_tokens_sorted)
    tc_prefix = [0.0] + cost.t_c_prefix(cur_tokens_sorted)[:-1]
    if n1 > _NUMPY_FROM:
        i = np.arange(n1)
        return (np.maximum(alpha + (n1 - i) * t_io, gpu_busy) + t_g < np.asarray(tc_prefix)).tolist()
    return [max(alpha + (n1 - i) * t_io, gpu_busy) + t_g < tc_prefix[i] for i in range(n1)]


def first_load(passes: Sequence[bool], outside: int) -> int:
    """OndemandLoop: the first passing i' among E_cur's members of GPU_Q. E_cur and E_all share the
    ascending order, so those are E_cur[outside:], `outside` = current-layer experts outside GPU_Q."""
    return next((i for i in range(outside, len(passes)) if passes[i]), len(passes))


def loads_pay_for_host_copies(cur_tokens_sorted: Sequence[float], i: int, alpha: float, t_load: float, t_io: float,
                              t_g: float, cost: CostModel, gpu_busy: float = 0.0,
                              all_cpu: Optional[float] = None) -> bool:
    """Where the link copies on the host cores (`cost.link_cpu_share` > 0), loading E_cur[i..n] also
    takes share * t_io of CPU time per load from the CPU side, and where the device computes on them
    (`cost.device_cpu_share` > 0) that share of each loaded expert's call: the loads go ahead only if
    the layer still ends sooner than with every missing expert on the CPU (always True with a DMA
    link to a GPU). `all_cpu`: that all-CPU time, when the caller already has it."""
    n1, share, s_dev = len(cur_tokens_sorted), cost.link_cpu_share, cost.device_cpu_share
    if (share <= 0 and s_dev <= 0) or i >= n1:
        return True
    t_cpu = cost.t_c_sum(cur_tokens_sorted[:i]) + (n1 - i) * (share * t_io + s_dev * t_g)
    t_gpu = max(alpha + (n1 - i) * t_load, gpu_busy) + t_g
    return max(t_cpu, t_gpu) < (cost.t_c_sum(cur_tokens_sorted) if all_cpu is None else all_cpu)


def prefetch_gap(cur_tokens_sorted: Sequence[float], i: int, alpha: float, t_io: float, cost: CostModel,
                 gpu_busy: float = 0.0) -> float:
    """Eq. 5's T_gap: CPU time of E_cur[0..i-1] (or the GPU's own work, when longer) minus the link
    time still owed and the loads E_cur[i..n]."""
    n1 = len(cur_tokens_sorted)
    return max(cost.t_c_sum(cur_tokens_sorted[:i]), gpu_busy) - alpha - (n1 - i) * t_io


def round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def prefetch_count(t_gap: float, t_attn: float, t_io: float, hit_rate: float, half_up: bool = True) -> tuple[int, float, float]:
    """Eqs. 5-6: (prefetches to issue, f, xi). Never negative."""
    f = (t_gap + t_attn) / t_io
    f_int = round_half_up(f) if half_up else int(round(f))
    xi = hit_rate * (f - f_int + 1) * t_io - (1.0 - hit_rate) * (f_int - f) * t_io
    count = f_int if xi > 0 else f_int - 1
    return max(count, 0), f, xi


def resident_to_cpu(state: LayerState, ready: Sequence[int], cpu: Sequence[int], n_loads: int, alpha: float,
                    t_load: float, t_g: float) -> list[int]:
    """`offload_resident`: resident experts of this layer to run on the CPU too, coldest first.

    The layer ends at max(T_C, T_G) with T_C = t_c_sum(CPU experts) and T_G = max(GPU work on
    ready experts + shared experts, alpha + n_loads t_load) + t_g when something is loaded; an
    expert moves while moving it lowers that maximum (Algorithm 1 never revisits resident experts,
    so at moderate batches of many small experts the GPU computes while the CPU waits). Where device
    compute takes a share s of the host cores (`cost.device_cpu_share`), each side also waits for s
    of the other's compute.

    One pass over the candidates with running sums (the CPU side's tokens and expert count, the GPU side's
    per-expert times), so a layer of n resident experts costs O(n log n) (the sort), not O(n^2) from re-summing
    both sides per candidate: the CPU side's sums are integers, exactly `t_c_sum`'s; the GPU side's differ from
    `t_g_group_sum`'s only by rounding, where no move decides on (a move must lower the layer time strictly)."""
    cost, times = state.cost, layer_expert_times(state)
    tokens = times.tokens
    resident = state.resident[state.layer].tolist()
    candidates = sorted_by([e for e in ready if resident[e]], tokens)
    if not candidates:
        return []
    s = cost.device_cpu_share
    link = alpha + n_loads * t_load
    tail = t_g if n_loads else 0.0
    floor = link + tail  # T_G never drops below the link's share, whatever moves
    shared = cost.t_shared(state.batch_tokens)
    call = cost.call_overhead_s
    beta, startup, dispatch = cost.beta_s, cost.cpu_startup_s, cost.cpu_dispatch_s
    cpu_m = [float(tokens[e]) for e in cpu if tokens[e] > 0]
    cpu_total, cpu_n = sum(cpu_m), len(cpu_m)  # integer token counts: exact running sums
    g_each = times.gpu  # each expert's `t_g` (the values `gpu_times` gives)
    g_times = {e: g_each[e] for e in ready if tokens[e] > 0}
    g_sum, g_n = sum(g_times.values()), len(g_times)

    def layer_time(t_cpu: float, g_sum: float, g_n: int) -> float:
        work = (g_sum - (g_n - 1) * call if g_n else 0.0) + shared  # one device call: its dispatch paid once
        return max(t_cpu + s * work, max(work + s * t_cpu, link) + tail)

    def cpu_time(total: float, n: int) -> float:  # `CostModel.t_c_sum` of n experts holding `total` tokens
        return beta * total + startup * n + dispatch if n else 0.0

    best = layer_time(cpu_time(cpu_total, cpu_n), g_sum, g_n)
    moved: list[int] = []
    for e in candidates:
        t_cpu = cpu_time(cpu_total + tokens[e], cpu_n + 1)
        if max(t_cpu, floor) >= best:  # a lower bound of the layer with e moved: no gain possible
            break
        g_left = g_sum - g_times[e]
        t = layer_time(t_cpu, g_left, g_n - 1)
        if t >= best:
            break
        best, g_sum, g_n = t, g_left, g_n - 1
        cpu_total, cpu_n = cpu_total + tokens[e], cpu_n + 1
        moved.append(e)
    return moved


@dataclass
class Lookahead:
    """E_next and the cross-layer queue (eq. 3) per target layer of one plan, built on first use:
    E_next reads the target's forecast (`LayerState.predicted` runs the predictor on first access),
    so a plan that never needs a layer's queue never forecasts it."""

    state: LayerState
    use_predictor: bool
    cur: list[int]  # E_cur, ascending tokens
    cur_m: list[float]
    alpha: float
    t_load: float
    t_g: float
    t_attn: float
    busy: float
    gap: float = 0.0  # eq. 5's T_gap of the plan's split (`PreSched.plan` sets it before asking for prefetches)
    _queues: dict[int, CrossLayerQueue] = field(default_factory=dict)
    _candidates: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)

    def forecast(self, target: int) -> bool:
        """Whether a forecast of `target` exists (without running the predictor)."""
        return self.use_predictor and target in self.state.predicted

    def candidates(self, target: int) -> tuple[list[int], list[float]]:
        """E_next for `target`: predicted experts neither resident nor landing (ascending predicted tokens).
        Built once per target (the queue and the prefetch both read it); callers must not modify the lists."""
        if target in self._candidates:
            return self._candidates[target]
        if not self.forecast(target):
            return [], []
        pred_a = self.state.predicted[target]
        some = np.flatnonzero(pred_a > 0)  # the few predicted experts of a layer, then the availability test
        some = some[~self.state.available(target)[some]]
        pred = pred_a[some].tolist()  # those experts' forecasts only (not every expert's)
        order = sorted(range(len(pred)), key=pred.__getitem__)  # ascending, stable: ties by id, as `sorted_by`
        ids = some.tolist()
        out = self._candidates[target] = ([ids[i] for i in order], [pred[i] for i in order])
        return out

    def has_next(self, target: int) -> bool:
        """Whether `target`'s cross-layer queue holds one of its experts: never where E_next is empty (every predicted
        expert cached or landing), so no queue is built there."""
        return bool(self.candidates(target)[0]) and self.queue(target).has_next

    def queue(self, target: int) -> CrossLayerQueue:
        if target not in self._queues:
            nxt, nxt_m = self.candidates(target)
            self._queues[target] = cross_layer_queue(self.cur, self.cur_m, nxt, nxt_m, self.alpha, self.t_load,
                                                     self.t_g, self.t_attn, self.state.cost, self.busy)
        return self._queues[target]


@dataclass(frozen=True)
class PreSchedSettings(SchedulerSettings):
    """PreSched's knobs (conf/scheduler/presched.yaml and its ablations) beside the shared ones."""

    kind: str = "presched"
    label: str = "LayerScope"
    max_window: int = 3  # Q4: furthest layer distance the prefetch window may extend to
    round_half_up: bool = True  # eq. 5: |f| = round(f) with halves rounded up (else banker's rounding)
    mask_gpu_compute: bool = True  # Premise 5 as written; False: T_G and T_gap count the GPU's work on resident experts
    offload_resident: bool = False  # extension: in decode, move the coldest resident experts to the idle CPU
    #   while that shortens the layer (max(T_C, T_G)); Algorithm 1 as written keeps every resident expert on the GPU

    @property
    def forecast_window(self) -> int:
        return max(self.max_window, 1)


@register("presched", settings=PreSchedSettings)
class PreSched(OffloadPolicy):
    """LayerScope's scheduler; see the module docstring."""

    @property
    def resident_on_device(self) -> bool:
        """The extension may run cold resident experts on the CPU, unless the device is the host itself
        (`device_cpu_share` 1): there a CPU expert takes the cores the device needs, no idle CPU."""
        return not self.settings.offload_resident or self.cost.device_cpu_share >= 1

    def _window(self) -> int:
        """Q4: the furthest layer distance prefetches may target (0: no predictor, no prefetch)."""
        return max(self.settings.max_window, 1) if self.settings.use_predictor else 0

    def _decode_prefetch(self, state: LayerState, ahead: Lookahead, gap: float) -> list[tuple[int, int]]:
        """Eqs. 5-6 and Q4: the hottest E_next experts of the first target whose GPU_Q holds one."""
        t_io, layer = state.t_io_s, state.layer
        share = state.cost.link_cpu_share
        if share > 0 and state.cost.t_c(state.batch_tokens) <= share * t_io:
            return []  # no expert (at most every token of the batch) runs longer on the CPU than its host copy
        distances, counts = self._prefetch_counts(state, gap)
        for j, distance in enumerate(distances):
            if not any(counts[j:]):
                break  # no count left to issue at this or any further distance: the forecasts cannot matter
            target = layer + distance
            if not ahead.forecast(target) or not ahead.has_next(target):
                continue  # Q4: nothing of this layer belongs on the GPU; look further ahead
            nxt, nxt_m = ahead.candidates(target)
            if share > 0:  # a host-copied prefetch costs CPU time now: only experts whose CPU run costs more
                nxt = [e for e, m in zip(nxt, nxt_m) if state.cost.t_c(m) > share * t_io]
            return [(target, e) for e in nxt[::-1][:counts[j]]]  # hottest first
        return []

    def _prefetch_counts(self, state: LayerState, gap: float) -> tuple[list[int], list[int]]:
        """Eqs. 5-6 per layer distance of the window: (distances, prefetches to issue at each)."""
        distances = [d for d in range(1, self._window() + 1) if state.layer + d < state.num_layers]
        counts = [prefetch_count(gap, state.t_attn_next_s, state.t_io_s, state.hit_rate.get(d, 1.0),
                                 self.settings.round_half_up)[0] for d in distances]
        return distances, counts

    def _prefill_prefetch(self, state: LayerState, ahead: Lookahead) -> list[tuple[int, int]]:
        """Every predicted expert of the next layer worth a transfer there (t_c above t_io), hottest first."""
        if not self._window():
            return []
        nxt, nxt_m = ahead.candidates(state.layer + 1)
        return [(state.layer + 1, e) for e, m in zip(nxt[::-1], nxt_m[::-1]) if state.cost.t_c(m) > state.t_io_s]

    def plan(self, state: LayerState) -> LayerPlan:
        layer, tokens, cost = state.layer, state.tokens, state.cost
        # a prefill on a host-copied link leaves the decode working set alone: there decode transfers
        # rarely pay for their copies, so an expert it displaced would stay displaced for the whole decode
        keep_working_set = state.phase is Phase.prefill and cost.link_cpu_share > 0
        if not keep_working_set:
            self.observe_usage(state)
        ready_a, missing = split_by_availability(state)
        tok = layer_expert_times(state).tokens  # shared by the splits of the plan: read-only
        ready = ready_a.tolist()
        cur = sorted_by(missing.tolist(), tok)
        cur_m = [float(tok[e]) for e in cur]
        alpha, t_io, t_attn = state.alpha_s, state.t_io_s, state.t_attn_next_s
        t_g = float(cost.t_g(max(max(tok, default=1), 1)))
        # the resident experts' GPU time, where the plan uses it (eq. 1's split, or counted GPU work)
        uses_ready = state.phase is Phase.prefill or not self.settings.mask_gpu_compute
        ready_s = sum(gpu_times(cost, [tok[e] for e in ready])) if uses_ready else 0.0
        # Premise 5 masks the GPU's work on resident experts; `mask_gpu_compute=False` counts it
        # (many small experts at moderate batch keep the GPU busy longer than the link)
        busy = 0.0 if self.settings.mask_gpu_compute else ready_s + cost.t_shared(state.batch_tokens)

        # one on-demand load occupies the GPU side for max(t_io, t_g): the paper's t_io under Premise 5
        # (t_g << t_io); where a device call costs more than a transfer, the calls are the bottleneck
        t_load = max(t_io, t_g)
        ahead = Lookahead(state, self.settings.use_predictor, cur, cur_m, alpha, t_load, t_g, t_attn, busy)
        if state.phase is Phase.prefill:
            i = greedy_split(np.asarray(cur_m, dtype=np.float64), ready_s + cost.t_shared(state.batch_tokens),
                             alpha, t_io, t_g, cost)
        else:
            passes = ondemand_passes(cur_m, alpha, t_load, t_g, cost, busy)
            if cost.link_cpu_share > 0 or cost.device_cpu_share > 0:  # a passing i' whose host time does not pay
                all_cpu = cost.t_c_sum(cur_m)  # the bar every passing i' must beat, computed once
                passes = [p and loads_pay_for_host_copies(cur_m, k, alpha, t_load, t_io, t_g, cost, busy, all_cpu)
                          for k, p in enumerate(passes)]
            # GPU_Q (and so the next layer's forecast) only matters when some i' passes eq. 4
            i = first_load(passes, ahead.queue(layer + 1).current_outside() if any(passes) else 0)
        cpu_experts = cur[:i]
        if not self.resident_on_device and state.phase is Phase.decode:
            moved = resident_to_cpu(state, ready, cpu_experts, len(cur) - i, alpha, t_load, t_g)
            ready = [e for e in ready if e not in moved]
            cpu_experts = cpu_experts + moved
        # eq. 5 over the final CPU side (E_cur[0..i-1] plus any moved resident expert) and loads E_cur[i..n]
        gap = prefetch_gap([tok[e] for e in cpu_experts] + cur_m[i:], len(cpu_experts), alpha, t_load, cost, busy)
        cpu = tuple(cpu_experts)
        loads = tuple(cur[i:][::-1])  # hottest first
        gpu = tuple(ready) + loads
        self.touch(layer, gpu)

        ahead.gap = gap
        prefetch = self._prefill_prefetch(state, ahead) if state.phase is Phase.prefill else \
            self._decode_prefetch(state, ahead, gap)
        return self.finish(state, cpu, gpu, loads, prefetch, keep_working_set, ahead)

    def finish(self, state: LayerState, cpu: tuple[int, ...], gpu: tuple[int, ...], loads: tuple[int, ...],
               prefetch: list[tuple[int, int]], keep_working_set: bool, ahead: Optional[Lookahead] = None
               ) -> LayerPlan:
        """The plan of Algorithm 1's split and prefetches, with cache slots made for them (a subclass may choose
        another split here: Horizon, reusing the E_next lists `ahead` built)."""
        return self.plan_with_slots(state, cpu, gpu, loads, prefetch, keep_working_set)
