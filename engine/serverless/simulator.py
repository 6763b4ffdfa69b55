"""Trace simulator of serverless experts: every iteration, every MoE layer, every system.

Two phases. `forecast_loads` turns a `ServingTrace` into the load forecasts a system plans from
(per step and layer: the predictor's forecast made d layers earlier, or history); it depends only
on the predictor, so systems that share one share the forecasts. `simulate_system` then walks the
steps in order; per MoE layer the policy plans from the forecast (warm-start candidates: what is
alive in the layer's slots), the slot map applies the plan (counting weight copies), the layer
costs what the §3.3 model says for the loads that really occurred (re-routed ones for the lossy
Oracle), and the policy observes those loads.

Weight copies are on the clock. Each device has one receive queue (`ServerlessCostModel.copy_times`
per copy); the layers of a step run one after another (attention block T_misc, then the MoE layer).
A policy's copies move as its `transfer` says: `ahead` (MoEless) issues them when the plan can be
made, at the start of layer l - d's block for a forecast d layers ahead (for history forecasts when
the layer last ran, in the previous step), so they overlap the compute in between and the MoE layer
waits only for what has not arrived; `background` (EPLB with vLLM's async transfer) queues them and
never waits; `blocking` waits for all of them before the layer. The wait is part of the layer's MoE time (`moe_s`, every
headline number, CDF and cost); `exec_s` is the time without it. The first placement of each layer
(loading the model) is free for every system. With decode_stride n, a simulated step stands for n
iterations: MoEless's copies and waits count n times (it re-plans every iteration), a periodic
rearrangement's (EPLB) once; the copies of the skipped iterations do not enter the queue, so
MoEless's waits are a lower bound (exact at decode_stride=1).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from engine.serverless.latency_model import Billing, ServerlessCostModel
from engine.serverless.policies import ForecastKind, SystemSpec, build_policy, slots_per_device
from engine.serverless.serving_trace import ServingTrace
from engine.serverless.slots import SlotMap, Source
from core.trace import PREFILL
from predictors.base import LayerContext, Predictor, topk_experts
from predictors.historical_load import HistoricalLoadForecaster
from schedulers.ep_placement import balancedness


def forecast_loads(trace: ServingTrace, predictor: Optional[Predictor], history_decay: float = 1.0,
                   progress: Callable = lambda it, desc: it) -> tuple[np.ndarray, dict[str, float]]:
    """float32 [S, L, E]: the forecast each layer is planned from.

    With a predictor of distance d: layer l >= d from the predictor at layer l - d of the same
    step; layers l < d (and every layer without a predictor) from the historical shares of the
    steps before, scaled to this step's assignments. Returns the forecasts and the predictor's
    measured top-k hit rate per target layer ({} without a predictor).
    """
    S, L, E, k = trace.num_steps, trace.num_layers, trace.num_experts, trace.top_k
    history = HistoricalLoadForecaster(L, E, decay=history_decay)
    out = np.zeros((S, L, E), dtype=np.float32)
    d = predictor.distance if predictor is not None else L
    experts, weights, hidden = trace.routing.experts, trace.routing.weights, trace.routing.hidden
    # a predictor of a shallower recorded model replayed on its cycled layers (forecast.TiledPredictor) has no
    # model pair across a cycle's end: those targets fall back to history, as layers l < d do
    covers = getattr(predictor, "covers", lambda source_layer: True)
    # score the very forecast that was used where the predictor lets us (else it forecasts again)
    scored = predictor is not None and "predicted" in inspect.signature(predictor.observe).parameters
    for s in progress(range(S), "forecast"):
        rows = trace.rows(s)
        n = rows.size
        for layer in range(L):
            if layer < d or not covers(layer - d):
                out[s, layer] = history.forecast(layer, n * k)
                continue
            ctx = LayerContext(layer=layer - d, step=s, experts=experts[layer - d, rows], weights=weights[layer - d, rows],
                               hidden=None if hidden is None else hidden[layer - d, rows],
                               seq=trace.routing.seq[rows], pos=trace.routing.pos[rows], rows=rows)
            top = topk_experts(predictor.predict(ctx), k)
            out[s, layer] = np.bincount(top.reshape(-1), minlength=E)
            actual = experts[layer, rows].astype(np.int64)
            if scored:
                predictor.observe(layer, ctx, actual, predicted=top)
            else:
                predictor.observe(layer, ctx, actual)
        for layer in range(L):
            history.observe(layer, trace.loads[s, layer])
    hits = {} if predictor is None else {str(layer): predictor.hit_rate(layer) for layer in range(d, L) if covers(layer - d)}
    return out, hits


class CopyLinks:
    """Each device's receive queue for weight copies: copies to one device run one after another."""

    def __init__(self, num_devices: int):
        self.free = np.zeros(num_devices)  # when each device's queue is idle (simulated seconds)

    def copy(self, per_device_s: np.ndarray, issue_s: float, ready_s: float, transfer: str) -> float:
        """Queue one layer's copies (seconds per receiving device) and return how long the layer, ready
        to run at `ready_s`, waits for them: `ahead` copies start at `issue_s` (or when the queue frees),
        `blocking` ones at `ready_s`; `background` ones are queued but never waited for."""
        busy = np.asarray(per_device_s) > 0
        if not busy.any():
            return 0.0
        start = ready_s if transfer == "blocking" else issue_s
        self.free[busy] = np.maximum(self.free[busy], start) + np.asarray(per_device_s)[busy]
        if transfer == "background":
            return 0.0
        return max(0.0, float(self.free[busy].max()) - ready_s)


@dataclass
class SystemResult:
    """Per step s and MoE layer l of one system (arrays [S, L] unless noted)."""

    label: str
    kind: str
    lossy: bool
    serverless: bool
    slots_per_device: int
    weight: np.ndarray  # [S] iterations each step stands for
    phase: np.ndarray  # [S]
    moe_s: np.ndarray  # T_moe including the wait for weight copies (the headline latency)
    moe_other_s: np.ndarray  # T_moe under the other compute kind (see latency_model), same wait included
    compute_s: np.ndarray
    comm_s: np.ndarray
    misc_s: np.ndarray  # [S]
    replicas: np.ndarray
    balancedness: np.ndarray
    cost: np.ndarray  # byte-seconds under the headline billing
    billed_bytes: np.ndarray  # expert memory billed while the layer runs (headline billing)
    moves: dict[str, int] = field(default_factory=dict)  # weight copies by source (warm / peer / host)
    moves_after_first: dict[str, int] = field(default_factory=dict)  # excluding each layer's first plan
    expert_bytes: float = 0.0
    decision_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [S, L] time in policy.plan
    copy_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [S, L] weight copies the plan needs
    exposed_copy_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [S, L] copy time not hidden
    exec_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [S, L] T_moe without copy waits
    costs: dict[str, np.ndarray] = field(default_factory=dict)  # billing name -> [S, L] byte-seconds
    held_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [S, L] expert memory resident
    billing: str = Billing.held.value
    transfer: str = "ahead"
    moves_weighted: dict[str, float] = field(default_factory=dict)  # after the first plan, x iterations
    hit_cap: int = 0
    rebalances: int = 0

    def w(self) -> np.ndarray:
        return np.broadcast_to(self.weight[:, None], self.moe_s.shape)

    def summary(self) -> dict:
        w = self.w()
        total_w = float(w.sum())
        mean = lambda a: float((a * w).sum() / total_w)
        q = weighted_quantiles(self.moe_s.reshape(-1), w.reshape(-1), [0.5, 0.9, 0.99])
        by_phase = {}
        for name, ph in (("prefill", 0), ("decode", 1)):
            m = self.phase == ph
            if m.any():
                wp = w[m]
                by_phase[name] = {"mean_moe_ms": float((self.moe_s[m] * wp).sum() / wp.sum()) * 1e3,
                                  "iterations": float(self.weight[m].sum())}
        return {
            "label": self.label, "kind": self.kind, "lossy": self.lossy, "serverless": self.serverless,
            "slots_per_device": self.slots_per_device,
            "mean_moe_ms": mean(self.moe_s) * 1e3, "mean_moe_other_compute_ms": mean(self.moe_other_s) * 1e3,
            "p50_moe_ms": q[0] * 1e3, "p90_moe_ms": q[1] * 1e3,
            "p99_moe_ms": q[2] * 1e3, "mean_compute_ms": mean(self.compute_s) * 1e3,
            "mean_comm_ms": mean(self.comm_s) * 1e3,
            # the layer's attention block (T_misc): a copy issued a layer ahead overlaps it and the MoE part
            "mean_misc_ms": mean(np.broadcast_to(self.misc_s[:, None], self.moe_s.shape)) * 1e3,
            "total_moe_s": float((self.moe_s * w).sum()),
            "total_cost_gib_s": float((self.cost * w).sum()) / 2**30,
            "mean_replicas_per_layer": mean(self.replicas),
            "mean_balancedness": mean(self.balancedness),
            "expert_memory_time_avg_gib": float((self.billed_bytes * self.moe_s * w).sum() / max((self.moe_s * w).sum(), 1e-30)) / 2**30,
            "weight_copies": dict(self.moves), "weight_copies_after_first_plan": dict(self.moves_after_first),
            "bytes_moved_gib": (self.moves.get("host", 0) + self.moves.get("peer", 0)) * self.expert_bytes / 2**30,
            "bytes_moved_after_first_gib": (self.moves_after_first.get("host", 0) + self.moves_after_first.get("peer", 0))
            * self.expert_bytes / 2**30,
            "copy_ms_total": float((self.copy_s * w).sum()) * 1e3,
            "exposed_copy_ms_total": float((self.exposed_copy_s * w).sum()) * 1e3,
            "mean_moe_exec_ms": mean(self.exec_s) * 1e3 if self.exec_s.size else mean(self.moe_s) * 1e3,
            "mean_copy_wait_ms": mean(self.exposed_copy_s) * 1e3 if self.exposed_copy_s.size else 0.0,
            "copy_transfer": self.transfer,
            "billing": self.billing,
            "cost_by_billing_gib_s": {k: float((c * w).sum()) / 2**30 for k, c in self.costs.items()},
            "held_memory_time_avg_gib": float((self.held_bytes * self.moe_s * w).sum() / max((self.moe_s * w).sum(), 1e-30))
            / 2**30 if self.held_bytes.size else 0.0,
            **self.copy_summary(),
            "decision_us_mean": float(self.decision_s.mean() * 1e6) if self.decision_s.size else 0.0,
            "decision_us_p99": float(np.quantile(self.decision_s, 0.99) * 1e6) if self.decision_s.size else 0.0,
            "scaler_hit_cap_fraction": self.hit_cap / max(self.moe_s.size, 1),
            "eplb_rebalances": self.rebalances,
            "by_phase": by_phase,
        }

    def copy_summary(self) -> dict:
        """Weight copies after each layer's first placement, counted per serving iteration (a step that
        stands for n iterations counts its copies n times): copies, GiB, and the share of placed
        replicas that were already alive where they were placed (warm starts)."""
        mw = self.moves_weighted
        copies = mw.get("host", 0.0) + mw.get("peer", 0.0)
        placed = copies + mw.get("warm", 0.0)
        return {"copies": copies, "cold_starts": mw.get("host", 0.0), "copies_gib": copies * self.expert_bytes / 2**30,
                "warm_start_rate": mw.get("warm", 0.0) / placed if placed else 1.0}

    def balancedness_per_layer(self) -> list[float]:
        w = self.w()
        return ((self.balancedness * w).sum(axis=0) / w.sum(axis=0)).tolist()


def weighted_quantiles(values: np.ndarray, weights: np.ndarray, qs: list[float]) -> list[float]:
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    c = np.cumsum(w)
    c = c / c[-1]
    return [float(v[min(np.searchsorted(c, q, side="left"), v.size - 1)]) for q in qs]


def cdf_points(values: np.ndarray, weights: np.ndarray, max_points: int = 400) -> tuple[list[float], list[float]]:
    """(sorted values, cumulative fraction) thinned to at most `max_points` for plots and results."""
    order = np.argsort(values.reshape(-1), kind="stable")
    v = values.reshape(-1)[order]
    c = np.cumsum(weights.reshape(-1)[order])
    c = c / c[-1]
    idx = np.unique(np.linspace(0, v.size - 1, min(max_points, v.size)).astype(np.int64))
    return v[idx].tolist(), c[idx].tolist()


def simulate_system(trace: ServingTrace, spec: SystemSpec, forecasts: np.ndarray, cost_model: ServerlessCostModel,
                    progress: Callable = lambda it, desc: it) -> SystemResult:
    """Replay `trace` through one system; forecasts float [S, L, E] from `forecast_loads`."""
    S, L, E = trace.num_steps, trace.num_layers, trace.num_experts
    G = cost_model.num_devices
    M_e = cost_model.expert_bytes
    policy = build_policy(spec, E, G, M_e)
    policy.bind_timing(cost_model.timing())  # cost-aware policies forecast with the function they are charged by
    keep_alive = policy.keep_alive_s
    slots = slots_per_device(spec, E, G)
    maps = [SlotMap(E, G, slots) for _ in range(L)]
    shape = (S, L)
    moe, other, comp, comm = np.zeros(shape), np.zeros(shape), np.zeros(shape), np.zeros(shape)
    reps, bal, decide = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    copy, wait, exec_ = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    held = np.zeros(shape)
    costs = {b.value: np.zeros(shape) for b in Billing}
    transfer = getattr(policy, "transfer", "ahead")
    # a policy that re-plans from forecasts moves weights in every iteration a sampled step stands for; a
    # periodic rearrangement (EPLB) happens once, in the step that triggered it
    every_iteration = transfer == "ahead"
    ahead = spec.distance if policy.uses_forecast and spec.forecast is ForecastKind.predictor else 0
    misc = np.zeros(S)
    moves = {src.value: 0 for src in Source}
    later = {src.value: 0 for src in Source}
    weighted = {src.value: 0.0 for src in Source}
    links = CopyLinks(G)
    last_ran = np.zeros(L)  # when each layer last finished (its history forecast for the next step exists)
    clock = 0.0
    hit_cap = 0
    for s in progress(range(S), spec.label):
        now = float(trace.time_s[s])
        iters = float(trace.weight[s])
        misc[s] = cost_model.misc_time(int(trace.num_seqs[s]), trace.tokens(s), float(trace.context[s]),
                                       prefill=trace.phase[s] == PREFILL)
        block_start = np.zeros(L)
        for layer in range(L):
            block_start[layer] = clock
            maps[layer].expire(now, keep_alive)  # replicas idle past the keep-alive window are gone
            live = maps[layer].live()
            t0 = time.perf_counter()
            placement = policy.plan(layer, forecasts[s, layer], live, now)
            decide[s, layer] = time.perf_counter() - t0
            hit_cap += int(policy.last_stats.hit_memory_cap)
            update = maps[layer].apply(placement, now, policy.peer_copies)
            maps[layer].expire(now, keep_alive)  # a serverful policy frees what the new placement does not use
            counts, host_in, peer_in = update.tally(G)
            for src, n in counts.items():
                moves[src.value] += n
                if live is not None:
                    later[src.value] += n
                    weighted[src.value] += n * (iters if every_iteration else 1.0)
            per_dev = cost_model.copy_times(host_in, peer_in)
            copy[s, layer] = float(per_dev.max(initial=0.0))
            ready = clock + misc[s]  # the MoE layer could start once its attention block is done
            stall = 0.0
            if live is not None:  # the first placement of a layer is the model load, free for every system
                # a predictor's forecast exists at layer l - d's input; history shares once the layer last ran
                issue = block_start[layer - ahead] if 0 < ahead <= layer else last_ran[layer]
                stall = links.copy(per_dev, issue, ready, transfer)
                # a rearrangement's wait happens once, not in every iteration the sampled step stands for
                wait[s, layer] = stall if every_iteration else stall / iters
            eff = policy.effective_loads(trace.loads[s, layer])
            t = cost_model.moe_time(placement, eff)
            exec_[s, layer] = t.moe_s
            moe[s, layer], other[s, layer] = t.moe_s + wait[s, layer], t.moe_other_s + wait[s, layer]
            comp[s, layer], comm[s, layer] = t.compute_s, t.comm_s
            reps[s, layer] = placement.num_replicas
            bal[s, layer] = balancedness(placement.device_loads(eff))
            policy.observe(layer, trace.loads[s, layer], now, iterations=iters)
            clock = ready + exec_[s, layer] + stall
            last_ran[layer] = clock
        held[s] = sum(m.resident_replicas() for m in maps) * M_e
        for layer in range(L):
            for b in Billing:
                costs[b.value][s, layer] = cost_model.layer_cost(moe[s, layer], misc[s], held[s, layer],
                                                                 reps[s, layer] * M_e, policy.serverless, b)
    billing = cost_model.settings.billing
    billed = reps * M_e if billing is Billing.pay_per_use and policy.serverless else held
    return SystemResult(label=spec.label, kind=spec.kind, lossy=policy.lossy, serverless=policy.serverless,
                        slots_per_device=slots, weight=trace.weight.astype(np.float64), phase=trace.phase,
                        moe_s=moe, moe_other_s=other, compute_s=comp, comm_s=comm, misc_s=misc, replicas=reps, balancedness=bal,
                        cost=costs[billing.value], billed_bytes=billed, moves=moves, moves_after_first=later,
                        expert_bytes=M_e, decision_s=decide, copy_s=copy, exposed_copy_s=wait, exec_s=exec_, costs=costs,
                        held_bytes=held, billing=billing.value, transfer=transfer, moves_weighted=weighted,
                        hit_cap=hit_cap, rebalances=getattr(policy, "rebalances", 0))


def forecasts_for(spec: SystemSpec, cache: dict, trace: ServingTrace, make_predictor: Callable[[int], Optional[Predictor]],
                  history_decay: float, progress: Callable = lambda it, desc: it) -> np.ndarray:
    """The forecasts `spec` plans from, computed once per (forecast kind, distance)."""
    key = ("history", 0) if spec.forecast is ForecastKind.history else ("predictor", spec.distance)
    if key not in cache:
        predictor = None if key[0] == "history" else make_predictor(spec.distance)
        cache[key] = forecast_loads(trace, predictor, history_decay, progress)
    return cache[key][0]
