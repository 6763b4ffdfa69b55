"""HybriMoE (Zhong et al., 2025), as its public code behaves (PKU-SEC-Lab/HybriMoE, ktransformers
`KExpertsCache` / `KScoreAwareCache`), with LayerScope's shared transfer path and hot-table start:

- per-layer expert slots (an equal share of the cache per layer), started with each layer's
  hottest experts; a miss loads into the layer's slots, evicting the expert of lowest priority
  score, S = a * score + (1 - a) * S over the layer's top-2k scored experts (others decay by 1 - a);
- decode: the hybrid scheduling strategy (HSS): experts sorted cached-first then by tokens
  (descending); the GPU takes from the front, the CPU from the back, whichever side finishes
  earlier with the candidate, the GPU side waiting for its transfers (`move`) as it queues them;
- prefill: every expert on the GPU (misses through the staging buffer once the layer's slots are full);
- prefetch after the current layer's loads, `prefetch_policy`:
  - `impact` (HybriMoE's own, its §IV-B impact-driven prefetching; the default): for each of the next
    `prefetch_layers` layers with a forecast, HSS is simulated on the predicted token counts with and
    without each candidate expert cached (candidates: the layer's `2 k` most predicted experts not
    available); the impact of a candidate is the layer time it saves. Candidates go hottest impact first,
    the winner's layer re-simulated with it cached before the next pick, while the link has room within
    the current layer (its HSS time minus the loads queued and alpha, in transfer times) and the impact
    is positive;
  - `fixed` (LayerScope §5.3's description of HybriMoE, `conf/scheduler/hybrimoe_ls.yaml`): a fixed number
    (`prefetch_count`) of the next layer's top-scored experts, scored by the gate prediction (the
    predictor) when one is given, else by S.
  Transfers already queued for this layer run first (its `wait_prefetch` semantics: no cancellation);
  mispredicted ones are dropped rather than waited for, which can only help it.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from schedulers.base import LayerPlan, LayerState, Phase, SchedulerSettings, SchedulerSetup, register
from schedulers.policy import ExpertTimes, OffloadPolicy, by_tokens, expert_times, split_by_availability


def hybrid_scheduling(cached: np.ndarray, uncached: np.ndarray, tokens: np.ndarray, t_io: float, cost,
                      alpha: float = 0.0, times: ExpertTimes | None = None) -> tuple[list[int], list[int]]:
    """HSS: (cpu experts in assignment order, gpu experts in assignment order). `times`: `expert_times(tokens, cost)`
    where the caller has them."""
    cpu, gpu, _ = _hss(cached, uncached, tokens, t_io, cost, alpha, times)
    return cpu, gpu


def hss_time(cached: np.ndarray, uncached: np.ndarray, tokens: np.ndarray, t_io: float, cost,
             alpha: float = 0.0, times: ExpertTimes | None = None) -> float:
    """The layer time HSS expects: the later of its GPU side (transfers included) and its CPU side."""
    return _hss(cached, uncached, tokens, t_io, cost, alpha, times)[2]


def _hss(cached: np.ndarray, uncached: np.ndarray, tokens: np.ndarray, t_io: float, cost,
         alpha: float = 0.0, times: ExpertTimes | None = None) -> tuple[list[int], list[int], float]:
    times = times or expert_times(tokens, cost)
    key = times.tokens
    cached_l = np.asarray(cached).tolist()
    uncached_l = np.asarray(uncached).tolist()
    # cached first, each group by tokens descending (stable, as `by_tokens`); HybriMoE's impact scoring runs this
    # for every candidate of up to three layers per plan: plain lists over precomputed times, no numpy per call
    # (`reverse=True` keeps ties in their given order, as the negated key did: no Python call per element)
    order = sorted(cached_l, key=key.__getitem__, reverse=True) + sorted(uncached_l, key=key.__getitem__, reverse=True)
    t_gpu = [times.gpu[e] for e in order]
    t_cpu = [times.cpu[e] for e in order]
    is_move = [False] * len(cached_l) + [True] * len(uncached_l)
    gpu_total = cpu_total = 0.0
    move_total = alpha
    gpu: list[int] = []
    cpu: list[int] = []
    lo, hi = 0, len(order) - 1
    while lo <= hi:
        gpu_time = t_gpu[lo]
        cpu_time = t_cpu[hi]
        move = is_move[lo]
        if move and move_total + t_io > gpu_total:
            gpu_time += move_total + t_io - gpu_total
        if gpu_total + gpu_time <= cpu_total + cpu_time:
            gpu.append(order[lo])
            gpu_total += gpu_time
            if move:
                move_total += t_io
            lo += 1
        else:
            cpu.append(order[hi])
            cpu_total += cpu_time
            hi -= 1
    return cpu, gpu, max(gpu_total, cpu_total)


@dataclass(frozen=True)
class HybriMoESettings(SchedulerSettings):
    kind: str = "hybrimoe"
    label: str = "HybriMoE"
    prefetch_policy: str = "impact"  # impact: HybriMoE's impact-driven prefetching; fixed: LayerScope's description
    prefetch_count: int = 2  # fixed: next-layer experts prefetched per decode layer
    prefetch_layers: int = 3  # impact: layers ahead whose forecasts are scored
    score_ema: float = 0.5  # S = a * score + (1 - a) * S (KScoreAwareCache alpha)

    def __post_init__(self) -> None:
        if self.prefetch_policy not in ("impact", "fixed"):
            raise ValueError(f"scheduler.prefetch_policy: {self.prefetch_policy!r} is not impact|fixed")

    @property
    def forecast_window(self) -> int:
        """Impact-driven prefetching scores forecasts up to `prefetch_layers` ahead."""
        return max(self.prefetch_layers, 1) if self.prefetch_policy == "impact" else 1


@register("hybrimoe", settings=HybriMoESettings)
class HybriMoE(OffloadPolicy):
    per_layer_cache = True
    resident_on_device = False  # its greedy split may hand the least-loaded resident experts to the CPU

    def __init__(self, settings: HybriMoESettings, setup: SchedulerSetup):
        super().__init__(settings, setup)
        self.priority = np.zeros((self.L, self.E))

    def _update_scores(self, state: LayerState) -> None:
        a = self.settings.score_ema
        mean_score = state.scores / max(state.batch_tokens, 1)
        p = min(2 * self.k, self.E)
        top = np.argsort(-mean_score, kind="stable")[:p]
        top = top[mean_score[top] > 0]
        mask = np.zeros(self.E, dtype=bool)
        mask[top] = True
        row = self.priority[state.layer]
        row[mask] = a * mean_score[mask] + (1 - a) * row[mask]
        row[~mask] *= 1 - a

    def _place(self, state: LayerState, layer: int, experts: list[int], protect: set[int],
               evicted: list[tuple[int, int]], claimed: dict[int, int]) -> list[bool]:
        """Cache each expert in `layer`'s slots if room can be made (lowest priority evicted). `claimed`: slots of
        each layer this plan has already filled, so a slot freed by one eviction is given out once."""
        room = self.layer_room(state, layer, sum(1 for lay, _ in evicted if lay == layer)) - claimed.get(layer, 0)
        short = len(experts) - max(room, 0)
        if short > 0:
            gone = {x for lay, x in evicted if lay == layer}
            victims = self.layer_victims(state, layer, short, protect | gone, self.priority[layer])
            evicted.extend(victims)
            room = max(room, 0) + len(victims)
        placed = [i < room for i in range(len(experts))]
        claimed[layer] = claimed.get(layer, 0) + sum(placed)
        return placed

    def plan(self, state: LayerState) -> LayerPlan:
        layer, tokens = state.layer, state.tokens
        self._update_scores(state)
        ready, missing = split_by_availability(state)
        if state.phase is Phase.prefill:
            cpu, gpu_order = [], [int(e) for e in ready] + [int(e) for e in by_tokens(missing, tokens, descending=True)]
        else:
            cpu, gpu_order = hybrid_scheduling(ready, missing, tokens, state.t_io_s, state.cost)
        missing_set = set(int(e) for e in missing)
        queued_first = {t.expert for t in state.queued if t.layer == layer}
        loads = [e for e in gpu_order if e in missing_set]
        loads = [e for e in loads if e in queued_first] + [e for e in loads if e not in queued_first]
        gpu = [e for e in gpu_order if e not in missing_set] + loads
        self.touch(layer, gpu)
        evicted: list[tuple[int, int]] = []
        claimed: dict[int, int] = {}
        retain = self._place(state, layer, loads, set(gpu), evicted, claimed)
        prefetch: list[tuple[int, int]] = []
        target = layer + 1
        if self.settings.prefetch_policy == "impact":
            if state.phase is Phase.decode and target < state.num_layers:
                budget = self._link_room(state, cpu, gpu_order, missing_set, tokens, len(loads))
                for t, e in self._impact_prefetch(state, budget):
                    if self._place(state, t, [e], set(), evicted, claimed)[0]:
                        prefetch.append((t, e))
        elif state.phase is Phase.decode and target < state.num_layers and self.settings.prefetch_count > 0:
            if self.settings.use_predictor and target in state.predicted:
                score = state.predicted[target]
            else:
                score = self.priority[target]
            top = by_tokens(np.arange(self.E), score, descending=True)[:self.settings.prefetch_count]
            top = [int(e) for e in top if score[e] > 0 and not state.available(target)[e]]
            placed = self._place(state, target, top, set(), evicted, claimed)
            prefetch = [(target, e) for e, ok in zip(top, placed) if ok]
        return LayerPlan(cpu=tuple(cpu), gpu=tuple(gpu), ondemand=tuple(loads), retain=tuple(retain),
                         prefetch=tuple(prefetch), evict=tuple(evicted))

    # ---- impact-driven prefetching (HybriMoE §IV-B) -----------------------------------------------------------
    def _link_room(self, state: LayerState, cpu: list[int], gpu_order: list[int], missing: set[int],
                   tokens: np.ndarray, n_loads: int) -> int:
        """Transfers the link can take during this layer beyond its loads: the layer's expected time (its HSS
        split) minus alpha and the loads, in transfer times."""
        cost, t_io = state.cost, state.t_io_s
        m = tokens[gpu_order] if gpu_order else tokens[:0]
        gpu_side = sum(np.atleast_1d(cost.t_g(m)).tolist()) + state.alpha_s + n_loads * t_io  # `t_g` per expert
        cpu_side = cost.t_c_sum([int(tokens[e]) for e in cpu])
        layer_time = max(gpu_side, cpu_side) + state.t_attn_next_s
        return max(int((layer_time - state.alpha_s - n_loads * t_io) // t_io), 0)

    def _impact_prefetch(self, state: LayerState, budget: int) -> list[tuple[int, int]]:
        """Up to `budget` (layer, expert) prefetches, the largest simulated HSS saving first."""
        if budget <= 0 or not self.settings.use_predictor:
            return []
        cost, t_io = state.cost, state.t_io_s
        # target -> (predicted tokens, cached, uncached, candidates) of its predicted experts
        layers: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        for target in range(state.layer + 1, min(state.layer + 1 + self.settings.prefetch_layers, state.num_layers)):
            if target not in state.predicted:
                continue
            pred = np.asarray(state.predicted[target], dtype=np.float64)
            live = np.flatnonzero(pred > 0)
            avail = state.available(target)
            cached, uncached = live[avail[live]], live[~avail[live]]
            cand = by_tokens(uncached, pred, descending=True)[:2 * self.k]
            if cand.size:
                layers[target] = (pred, cached, uncached, cand)

        times = {t: expert_times(layers[t][0], cost) for t in layers}

        def impacts(target: int) -> list[tuple[float, int, int]]:
            pred, cached, uncached, cand = layers[target]
            base = hss_time(cached, uncached, pred, t_io, cost, times=times[target])
            out = []
            for e in cand.tolist():
                with_e = hss_time(np.append(cached, e), uncached[uncached != e], pred, t_io, cost, times=times[target])
                out.append((base - with_e, target, int(e)))
            return out

        scored = {t: impacts(t) for t in layers}
        chosen: list[tuple[int, int]] = []
        while len(chosen) < budget and scored:
            gain, target, e = max((x for xs in scored.values() for x in xs), default=(0.0, -1, -1))
            if gain <= 0:
                break
            chosen.append((target, e))
            pred, cached, uncached, cand = layers[target]
            layers[target] = (pred, np.append(cached, e), uncached[uncached != e], cand[cand != e])
            scored[target] = impacts(target) if layers[target][3].size else []
            if not scored[target]:
                del scored[target]
        return chosen
