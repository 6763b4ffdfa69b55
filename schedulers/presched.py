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

Prefetches are non-interruptible and the link is serial (Premises 3-4: the mechanism's contract);
prefetches land in the dynamic cache region (LRU); on-demand loads stay there too while it has room
(`retain_loads`: a buffer is only overwritten when needed), else they pass through the staging buffer.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from schedulers.base import LayerPlan, LayerState, Phase, SchedulerKind, register
from schedulers.cost import CostModel
from schedulers.layerwise import greedy_split
from schedulers.policy import OffloadPolicy, by_tokens, split_by_availability


@dataclass(frozen=True)
class CrossLayerQueue:
    """Eq. 3 over E_all: which entries join the GPU queue."""

    experts: np.ndarray  # int [N] E_all, ascending tokens
    tokens: np.ndarray  # float [N]
    is_current: np.ndarray  # bool [N]
    in_gpu_queue: np.ndarray  # bool [N]

    @property
    def has_next(self) -> bool:
        """GPU_Q holds an expert of the prefetch layer."""
        return bool((self.in_gpu_queue & ~self.is_current).any())

    def current_in_queue(self) -> np.ndarray:
        """E_all positions of current-layer experts in GPU_Q, coldest first."""
        return np.flatnonzero(self.in_gpu_queue & self.is_current)


def cross_layer_queue(cur: np.ndarray, cur_tokens: np.ndarray, nxt: np.ndarray, nxt_tokens: np.ndarray,
                      alpha: float, t_io: float, t_g: float, t_attn: float, cost: CostModel,
                      gpu_busy: float = 0.0) -> CrossLayerQueue:
    """Eq. 3. `cur`, `nxt`: expert ids (any order) with their (predicted) token counts."""
    experts = np.concatenate([np.asarray(cur, dtype=np.int64), np.asarray(nxt, dtype=np.int64)])
    tokens = np.concatenate([np.asarray(cur_tokens, dtype=np.float64), np.asarray(nxt_tokens, dtype=np.float64)])
    is_cur = np.concatenate([np.ones(len(cur), dtype=bool), np.zeros(len(nxt), dtype=bool)])
    order = np.lexsort((is_cur, tokens))  # ascending tokens; ties: next-layer expert first
    experts, tokens, is_cur = experts[order], tokens[order], is_cur[order]
    n_all = experts.size
    t_cpu = cost.t_c_prefix(tokens) if n_all else np.zeros(0)  # the CPU side's hand-over counted once
    k = np.arange(n_all)
    tg_all = np.maximum(alpha + (n_all - k) * t_io, gpu_busy) + t_g
    tc_all = t_cpu + t_attn
    return CrossLayerQueue(experts, tokens, is_cur, tg_all < tc_all)


def ondemand_start(queue: CrossLayerQueue, cur_sorted: np.ndarray, cur_tokens_sorted: np.ndarray, alpha: float,
                   t_io: float, t_g: float, cost: CostModel, gpu_busy: float = 0.0) -> int:
    """Eq. 4 / OndemandLoop: index i into E_cur (ascending) from which experts are loaded; len(E_cur) = none."""
    n1 = len(cur_sorted)
    if n1 == 0:
        return 0
    tc_prefix = np.concatenate([[0.0], cost.t_c_prefix(cur_tokens_sorted)])[:n1]  # t_c(E_cur[0..i-1])
    passes = np.maximum(alpha + (n1 - np.arange(n1)) * t_io, gpu_busy) + t_g < tc_prefix  # eq. 4 at every i'
    # E_cur and E_all share the ascending order, so the current-layer members of GPU_Q, coldest
    # first, are E_cur[j0:], j0 = how many current-layer experts sit outside the queue
    j0 = int((queue.is_current & ~queue.in_gpu_queue).sum())
    hits = np.flatnonzero(passes[j0:])
    return j0 + int(hits[0]) if hits.size else n1


def prefetch_gap(cur_tokens_sorted: np.ndarray, i: int, alpha: float, t_io: float, cost: CostModel,
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


def resident_to_cpu(state: LayerState, ready: np.ndarray, cpu: np.ndarray, n_loads: int, alpha: float,
                    t_load: float, t_g: float) -> np.ndarray:
    """`offload_resident`: resident experts of this layer to run on the CPU too, coldest first.

    The layer ends at max(T_C, T_G) with T_C = t_c_sum(CPU experts) and T_G = max(GPU work on
    ready experts + shared experts, alpha + n_loads t_load) + t_g when something is loaded; an
    expert moves while moving it lowers that maximum (Algorithm 1 never revisits resident experts,
    so at moderate batches of many small experts the GPU computes while the CPU waits)."""
    cost, tokens = state.cost, state.tokens
    candidates = by_tokens(ready[state.resident[state.layer, ready]], tokens)
    if not candidates.size:
        return candidates
    link = alpha + n_loads * t_load
    tail = t_g if n_loads else 0.0
    shared = cost.t_shared(state.batch_tokens)
    cpu_m = list(tokens[cpu])
    gpu_left = list(tokens[ready])

    def layer_time(cpu_m: list, gpu_m: list) -> float:
        gpu = float(np.sum(cost.t_g_group(np.asarray(gpu_m)))) if gpu_m else 0.0
        return max(cost.t_c_sum(np.asarray(cpu_m)), max(gpu + shared, link) + tail)

    best = layer_time(cpu_m, gpu_left)
    moved = []
    for e in candidates.tolist():
        gpu_try = list(gpu_left)
        gpu_try.remove(tokens[e])
        t = layer_time(cpu_m + [tokens[e]], gpu_try)
        if t >= best:
            break
        best, gpu_left = t, gpu_try
        cpu_m.append(tokens[e])
        moved.append(e)
    return np.asarray(moved, dtype=np.int64)


@register(SchedulerKind.presched)
class PreSched(OffloadPolicy):
    """LayerScope's scheduler; see the module docstring."""

    @property
    def resident_on_device(self) -> bool:
        return not self.settings.offload_resident  # the extension may run cold resident experts on the CPU

    def _next_candidates(self, state: LayerState, target: int) -> tuple[np.ndarray, np.ndarray]:
        """E_next for `target`: predicted experts neither resident nor landing (ascending predicted tokens)."""
        if not self.settings.use_predictor or target not in state.predicted:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        pred = state.predicted[target]
        cand = np.flatnonzero(pred > 0)
        cand = cand[~state.available(target)[cand]]
        cand = by_tokens(cand, pred)
        return cand, pred[cand].astype(np.float64)

    def plan(self, state: LayerState) -> LayerPlan:
        layer, tokens, cost = state.layer, state.tokens, state.cost
        ready, missing = split_by_availability(state)
        cur = by_tokens(missing, tokens)
        cur_m = tokens[cur].astype(np.float64)
        alpha, t_io, t_attn = state.alpha_s, state.t_io_s, state.t_attn_next_s
        t_g = float(cost.t_g(max(int(tokens.max(initial=1)), 1)))
        # Premise 5 masks the GPU's work on resident experts; `mask_gpu_compute=False` counts it
        # (many small experts at moderate batch keep the GPU busy longer than the link)
        busy = 0.0 if self.settings.mask_gpu_compute else \
            float(np.sum(np.atleast_1d(cost.t_g(tokens[ready])))) + cost.t_shared(state.batch_tokens)

        # one on-demand load occupies the GPU side for max(t_io, t_g): the paper's t_io under Premise 5
        # (t_g << t_io); where a device call costs more than a transfer, the calls are the bottleneck
        t_load = max(t_io, t_g)
        nxt, nxt_m = self._next_candidates(state, layer + 1)
        queue = cross_layer_queue(cur, cur_m, nxt, nxt_m, alpha, t_load, t_g, t_attn, cost, busy)
        if state.phase is Phase.prefill:
            ready_s = float(np.sum(np.atleast_1d(cost.t_g(tokens[ready])))) if ready.size else 0.0
            i = greedy_split(cur_m, ready_s + cost.t_shared(state.batch_tokens), alpha, t_io, t_g, cost)
        else:
            i = ondemand_start(queue, cur, cur_m, alpha, t_load, t_g, cost, busy)
        cpu_experts = cur[:i]
        if self.settings.offload_resident and state.phase is Phase.decode:
            moved = resident_to_cpu(state, ready, cpu_experts, len(cur) - i, alpha, t_load, t_g)
            ready = ready[~np.isin(ready, moved)]
            cpu_experts = np.concatenate([cpu_experts, moved])
        # eq. 5 over the final CPU side (E_cur[0..i-1] plus any moved resident expert) and loads E_cur[i..n]
        gap = prefetch_gap(np.concatenate([tokens[cpu_experts], cur_m[i:]]), len(cpu_experts), alpha, t_load,
                           cost, busy)
        cpu = tuple(cpu_experts.tolist())
        loads = tuple(cur[i:][::-1].tolist())  # hottest first
        gpu = tuple(ready.tolist()) + loads
        self.touch(layer, gpu)

        prefetch: list[tuple[int, int]] = []
        window = max(self.settings.max_window, 1) if self.settings.use_predictor else 0
        if state.phase is Phase.prefill and window:
            nxt1, m1 = self._next_candidates(state, layer + 1)
            worth = np.atleast_1d(cost.t_c(m1)) > t_io  # experts the next layer would rather load than run on the CPU
            prefetch = [(layer + 1, int(e)) for e in nxt1[worth][::-1]]
            window = 0
        for distance in range(1, window + 1):
            target = layer + distance
            if target >= state.num_layers:
                break
            if distance > 1:
                nxt, nxt_m = self._next_candidates(state, target)
                queue = cross_layer_queue(cur, cur_m, nxt, nxt_m, alpha, t_load, t_g, t_attn, cost, busy)
            if not queue.has_next:
                continue  # Q4: nothing of this layer belongs on the GPU; look further ahead
            hit = state.hit_rate.get(distance, 1.0)
            count, _, _ = prefetch_count(gap, t_attn, t_io, hit, self.settings.round_half_up)
            chosen = nxt[::-1][:min(count, nxt.size)]  # hottest first
            prefetch = [(target, int(e)) for e in chosen]
            break

        # prefetches need cache slots; loads stay in the dynamic region too while it has room (a buffer
        # is only overwritten when needed), else they go through the staging buffer
        want = len(prefetch) + len(loads)
        granted, evict = (want, []) if want <= state.free_slots else \
            self.room_for(state, want, {(layer, e) for e in gpu})
        prefetch = prefetch[:granted]
        keep = max(granted - len(prefetch), 0)
        for target, e in prefetch:
            self.last_used[target, e] = self._clock  # keep fresh prefetches away from the LRU end
        if self.settings.retain_loads:
            evict = evict[:max(len(prefetch) + min(keep, len(loads)) - max(state.free_slots, 0), 0)]
            retain = tuple(i < keep for i in range(len(loads)))
        else:
            evict = evict[:max(len(prefetch) - max(state.free_slots, 0), 0)]
            retain = (False,) * len(loads)
        return LayerPlan(cpu=cpu, gpu=gpu, ondemand=loads, retain=retain, prefetch=tuple(prefetch), evict=tuple(evict))
