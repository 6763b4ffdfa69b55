"""The studies of MoEless §6 as lists of systems, simulated once each over one serving trace.

- compare (Figs. 11-13): the configured systems (Megatron-LM, EPLB, Oracle, MoEless);
- memory (Fig. 14): EPLB with 0, 1, 2 redundant replicas per expert next to the others;
- distance (Figs. 17-18) and cv_threshold (Figs. 19-20): MoEless with d or V swept;
- ablation (Fig. 21): MoEless without its load predictor (history forecasts), without the scaler
  (one replica per expert), without the placer (fixed devices, no warm starts).

Systems that behave identically (same policy settings and forecasts) are simulated once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from engine.serverless.policies import ForecastKind, PolicyKind, SystemSpec
from engine.serverless.serving_trace import ServingTrace
from engine.serverless.simulator import SystemResult, forecasts_for, simulate_system
from engine.serverless.latency_model import ServerlessCostModel
from predictors.base import Predictor

LABELS = {PolicyKind.static_ep: "Megatron-LM", PolicyKind.eplb: "EPLB", PolicyKind.oracle: "Oracle (lossy)",
          PolicyKind.moeless: "MoEless"}

PAPER = {  # MoEless §6.2, averaged over models and datasets
    "latency_reduction_vs_megatron": 0.4319, "latency_reduction_vs_eplb": 0.2189,
    "cost_reduction_vs_megatron": 0.9268, "cost_reduction_vs_oracle": 0.8406, "cost_reduction_vs_eplb": 0.9511,
}


def eplb_redundant(per_expert: int, num_experts: int, num_devices: int) -> int:
    """Redundant experts for `per_expert` extra replicas per expert, rounded up to fill whole devices."""
    total = num_experts * (1 + per_expert)
    return -(-total // num_devices) * num_devices - num_experts


def experiment_systems(experiment: str, base: dict[PolicyKind, SystemSpec], systems: list[PolicyKind],
                       sweeps, num_experts: int, num_devices: int) -> list[SystemSpec]:
    """The systems one experiment compares (labels unique within it)."""
    moeless = base[PolicyKind.moeless]
    if experiment == "compare":
        return [base[kind] for kind in systems]
    if experiment == "memory":
        out = [base[PolicyKind.static_ep], base[PolicyKind.oracle], moeless]
        for r in sweeps.eplb_redundant_per_expert:
            n = eplb_redundant(int(r), num_experts, num_devices)
            eplb = replace(base[PolicyKind.eplb].eplb, num_redundant=n)
            out.append(replace(base[PolicyKind.eplb], eplb=eplb, label=f"EPLB +{r}/expert"))
        return out
    if experiment == "distance":
        return [replace(moeless, distance=int(d), label=f"MoEless d={d}") for d in sweeps.distances]
    if experiment == "cv_threshold":
        return [replace(moeless, moeless=replace(moeless.moeless, cv_threshold=float(v)), label=f"MoEless V={v:g}")
                for v in sweeps.cv_thresholds]
    if experiment == "ablation":
        return [moeless,
                replace(moeless, forecast=ForecastKind.history, label="MoEless w/o predictor"),
                replace(moeless, moeless=replace(moeless.moeless, use_scaler=False), label="MoEless w/o scaler"),
                replace(moeless, moeless=replace(moeless.moeless, use_placer=False), label="MoEless w/o placer")]
    raise ValueError(f"experiments: unknown experiment {experiment!r}")


def run_experiments(trace: ServingTrace, cost_model: ServerlessCostModel, experiments: list[str],
                    base: dict[PolicyKind, SystemSpec], systems: list[PolicyKind], sweeps,
                    make_predictor: Callable[[int], Optional[Predictor]], history_decay: float = 1.0,
                    progress: Callable = lambda it, desc: it
                    ) -> tuple[dict[str, list[tuple[SystemSpec, SystemResult]]], dict]:
    """Simulate every system the experiments need once; returns per experiment (spec, result)
    pairs and the forecast cache (forecasts and predictor hit rates per distance)."""
    done: dict[tuple, SystemResult] = {}
    cache: dict = {}
    out: dict[str, list[tuple[SystemSpec, SystemResult]]] = {}
    for exp in experiments:
        specs = experiment_systems(exp, base, systems, sweeps, trace.num_experts, cost_model.num_devices)
        for spec in specs:
            key = spec.key()
            if key not in done:
                forecasts = forecasts_for(spec, cache, trace, make_predictor, history_decay, progress)
                done[key] = simulate_system(trace, spec, forecasts, cost_model, progress)
        out[exp] = [(spec, done[spec.key()]) for spec in specs]
    return out, cache


def versus(results: dict[str, dict], label: str, other: str, metric: str) -> Optional[float]:
    """Relative reduction 1 - label/other of `metric` (None if either is missing)."""
    a, b = results.get(label, {}).get(metric), results.get(other, {}).get(metric)
    if a is None or not b:
        return None
    return 1.0 - a / b


def compare_with_paper(summaries: dict[str, dict]) -> dict:
    """MoEless's reductions beside the paper's."""
    m, meg, eplb, orc = LABELS[PolicyKind.moeless], LABELS[PolicyKind.static_ep], LABELS[PolicyKind.eplb], \
        LABELS[PolicyKind.oracle]
    ours = {
        "latency_reduction_vs_megatron": versus(summaries, m, meg, "mean_moe_ms"),
        "latency_reduction_vs_eplb": versus(summaries, m, eplb, "mean_moe_ms"),
        "latency_gap_to_oracle": (-versus(summaries, m, orc, "mean_moe_ms")) if versus(summaries, m, orc, "mean_moe_ms") is not None else None,
        "cost_reduction_vs_megatron": versus(summaries, m, meg, "total_cost_gib_s"),
        "cost_reduction_vs_oracle": versus(summaries, m, orc, "total_cost_gib_s"),
        "cost_reduction_vs_eplb": versus(summaries, m, eplb, "total_cost_gib_s"),
        "other_compute_latency_reduction_vs_megatron": versus(summaries, m, meg, "mean_moe_other_compute_ms"),
        "other_compute_latency_reduction_vs_eplb": versus(summaries, m, eplb, "mean_moe_other_compute_ms"),
    }
    return {"ours": ours, "paper": dict(PAPER)}


def default_specs(serverless, num_experts: int, num_devices: int, distance: int = 1) -> dict[PolicyKind, SystemSpec]:
    """The four systems of MoEless §6.1 from a typed `serverless` config (MoEless predicts `distance` ahead)."""
    from schedulers.eplb import EPLBSettings
    from schedulers.moeless import MoElessSettings

    s = serverless
    moeless = MoElessSettings(cv_threshold=s.scaler.cv_threshold, memory_cap_replicas=s.scaler.memory_cap_replicas,
                              max_replicas_per_expert=s.scaler.max_replicas_per_expert, warm_start=s.placer.warm_start)
    forecast = ForecastKind.predictor if s.forecast.use_predictor else ForecastKind.history
    eplb = EPLBSettings(num_redundant=s.eplb.num_redundant, rebalance_interval_s=s.eplb.rebalance_interval_s,
                        history_window_s=s.eplb.history_window_s, num_groups=s.eplb.num_groups, num_nodes=s.eplb.num_nodes)
    return {
        PolicyKind.static_ep: SystemSpec(PolicyKind.static_ep, LABELS[PolicyKind.static_ep]),
        PolicyKind.eplb: SystemSpec(PolicyKind.eplb, LABELS[PolicyKind.eplb], eplb=eplb),
        PolicyKind.oracle: SystemSpec(PolicyKind.oracle, LABELS[PolicyKind.oracle]),
        PolicyKind.moeless: SystemSpec(PolicyKind.moeless, LABELS[PolicyKind.moeless], moeless=moeless,
                                       forecast=forecast, distance=distance,
                                       capacity_slots=s.capacity_slots),
    }
