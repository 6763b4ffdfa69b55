"""The studies of MoEless §6 as lists of systems, simulated once each over one serving trace.

- compare (Figs. 11-13): the configured systems (Megatron-LM, EPLB, Oracle, MoEless);
- memory (Fig. 14): EPLB with 0, 1, 2 redundant replicas per expert next to the others, and EPLB
  holding as many replicas as MoEless has slots (the two at the same expert memory);
- distance (Figs. 17-18) and cv_threshold (Figs. 19-20): MoEless with d or V swept;
- ablation (Fig. 21): MoEless without its load predictor (history forecasts), without the scaler
  (one replica per expert), without the placer (fixed devices, no warm starts);
- frontier: every system and setting as a point of MoE-layer latency (copy waits included) against GPU
  memory held (`FRONTIER`: static EP, the Oracle, EPLB at several cadences and redundancies, CRAFT at
  several memory budgets, MoEless's paper loop and MoEless at its own strength with its knobs varied).

Systems are named by their registered policy (`systems`, `serverless.policies.<kind>`); the studies name
the paper's four. Systems that behave identically (same policy settings and forecasts) are simulated once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from engine.serverless.policies import ForecastKind, SystemSpec
from engine.serverless.serving_trace import ServingTrace
from engine.serverless.simulator import SystemResult, forecasts_for, simulate_system
from engine.serverless.latency_model import ServerlessCostModel
from predictors.base import Predictor
from schedulers.ep_placement import SERVERLESS

PAPER = {  # MoEless §6.2, averaged over models and datasets
    "latency_reduction_vs_megatron": 0.4319, "latency_reduction_vs_eplb": 0.2189,
    "cost_reduction_vs_megatron": 0.9268, "cost_reduction_vs_oracle": 0.8406, "cost_reduction_vs_eplb": 0.9511,
}


def eplb_redundant(per_expert: int, num_experts: int, num_devices: int) -> int:
    """Redundant experts for `per_expert` extra replicas per expert, rounded up to fill whole devices."""
    total = num_experts * (1 + per_expert)
    return -(-total // num_devices) * num_devices - num_experts


# The frontier's points: (label, policy kind, settings changed from serverless.policies.<kind>). MoEless's
# "paper loop" is its literal §4 loop (re-planned every iteration, replicas kept until overwritten); "strong"
# (conf/serverless/policy/moeless.yaml's values) adds a keep-alive window, scaler hysteresis, copy-aware
# re-placement and cost-aware scaling. Every setting is explicit here, so the points do not move with the YAML.
PAPER_LOOP = {"keep_alive_s": None, "hysteresis": 0.0, "copy_aware": False, "cost_aware_scaling": False}
STRONG = {"keep_alive_s": 1.0, "hysteresis": 0.1, "copy_aware": True, "lifetime_iterations": 64.0,
          "cost_aware_scaling": True}
FRONTIER: tuple[tuple[str, str, dict], ...] = (
    ("Megatron-LM", "static_ep", {}),
    ("Oracle (lossy, bound)", "oracle", {}),
    ("EPLB 3000/1000", "eplb", {"rebalance_interval_steps": 3000, "window_steps": 1000}),
    ("EPLB 1000/1000", "eplb", {"rebalance_interval_steps": 1000, "window_steps": 1000}),
    ("EPLB 100/100", "eplb", {"rebalance_interval_steps": 100, "window_steps": 100}),
    ("EPLB +2/device 3000/1000", "eplb", {"rebalance_interval_steps": 3000, "window_steps": 1000, "num_redundant": -2}),
    ("CRAFT budget 1/layer", "craft", {"budget_replicas_per_layer": 1.0}),
    ("CRAFT budget 4/layer", "craft", {"budget_replicas_per_layer": 4.0}),
    ("MoEless paper loop", "moeless", PAPER_LOOP),
    ("MoEless strong", "moeless", STRONG),
    ("MoEless strong, cold copies", "moeless", {**STRONG, "peer_copies": False}),
    ("MoEless strong, lifetime 1024", "moeless", {**STRONG, "lifetime_iterations": 1024.0}),
    ("MoEless strong, keep-alive 0", "moeless", {**STRONG, "keep_alive_s": 0.0}),
    ("MoEless strong, scaler by CV only", "moeless", {**STRONG, "cost_aware_scaling": False}),
)


def frontier_systems(base: dict[str, SystemSpec], num_devices: int) -> list[SystemSpec]:
    """The frontier's points as systems (num_redundant -k: k redundant replicas per device)."""
    out = []
    for label, kind, changes in FRONTIER:
        changes = dict(changes)
        if changes.get("num_redundant", 0) < 0:
            changes["num_redundant"] = -changes["num_redundant"] * num_devices
        out.append(system(base, kind, "experiments=frontier").with_settings(label=label, **changes))
    return out


def system(base: dict[str, SystemSpec], kind: str, key: str = "systems") -> SystemSpec:
    """The configured system of policy `kind`; a one-line error naming `key` and the known ones otherwise."""
    if kind not in base:
        SERVERLESS.get(kind, key=key)  # not registered at all: names every registered policy
        raise ValueError(f"{key}: {kind!r} has no settings in serverless.policies (configured: {', '.join(base)})")
    return base[kind]


def experiment_systems(experiment: str, base: dict[str, SystemSpec], systems: list[str],
                       sweeps, num_experts: int, num_devices: int) -> list[SystemSpec]:
    """The systems one experiment compares (labels unique within it)."""
    if experiment == "compare":
        return [system(base, kind) for kind in systems]
    if experiment == "frontier":
        return frontier_systems(base, num_devices)
    moeless = system(base, "moeless", f"experiments={experiment}")
    if experiment == "memory":
        out = [system(base, "static_ep", "experiments=memory"), system(base, "oracle", "experiments=memory"), moeless]
        eplb = system(base, "eplb", "experiments=memory")
        for r in sweeps.eplb_redundant_per_expert:
            n = eplb_redundant(int(r), num_experts, num_devices)
            out.append(eplb.with_settings(num_redundant=n, label=f"EPLB +{r}/expert"))
        # EPLB holding as many replicas as MoEless has slots: the two at the same expert memory
        same = moeless.settings.slots_per_device(num_experts, num_devices) * num_devices - num_experts
        out.append(eplb.with_settings(num_redundant=same, label="EPLB at MoEless's memory"))
        return out
    if experiment == "distance":
        return [replace(moeless, distance=int(d)).with_label(f"MoEless d={d}") for d in sweeps.distances]
    if experiment == "cv_threshold":
        return [moeless.with_settings(cv_threshold=float(v), label=f"MoEless V={v:g}") for v in sweeps.cv_thresholds]
    if experiment == "ablation":
        return [moeless,
                replace(moeless, forecast=ForecastKind.history).with_label("MoEless w/o predictor"),
                moeless.with_settings(use_scaler=False, label="MoEless w/o scaler"),
                moeless.with_settings(use_placer=False, label="MoEless w/o placer")]
    raise ValueError(f"experiments: unknown experiment {experiment!r}")


def run_experiments(trace: ServingTrace, cost_model: ServerlessCostModel, experiments: list[str],
                    base: dict[str, SystemSpec], systems: list[str], sweeps,
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


def compare_with_paper(summaries: dict[str, dict], labels: dict[str, str]) -> dict:
    """MoEless's reductions beside the paper's (labels: policy kind -> label in `summaries`)."""
    m, meg, eplb, orc = (labels.get(kind) for kind in ("moeless", "static_ep", "eplb", "oracle"))
    ours = {
        "latency_reduction_vs_megatron": versus(summaries, m, meg, "mean_moe_ms"),
        "latency_reduction_vs_eplb": versus(summaries, m, eplb, "mean_moe_ms"),
        "latency_gap_to_oracle": (-versus(summaries, m, orc, "mean_moe_ms")) if versus(summaries, m, orc, "mean_moe_ms") is not None else None,
        "cost_reduction_vs_megatron": versus(summaries, m, meg, "total_cost_gib_s"),
        "cost_reduction_vs_oracle": versus(summaries, m, orc, "total_cost_gib_s"),
        "cost_reduction_vs_eplb": versus(summaries, m, eplb, "total_cost_gib_s"),
        "other_compute_latency_reduction_vs_megatron": versus(summaries, m, meg, "mean_moe_other_compute_ms"),
        "other_compute_latency_reduction_vs_eplb": versus(summaries, m, eplb, "mean_moe_other_compute_ms"),
        # without the waits for weight copies (what the paper's figures show), for comparison only
        "exec_only_latency_reduction_vs_megatron": versus(summaries, m, meg, "mean_moe_exec_ms"),
        "exec_only_latency_reduction_vs_eplb": versus(summaries, m, eplb, "mean_moe_exec_ms"),
    }
    billings = sorted({b for s in summaries.values() for b in s.get("cost_by_billing_gib_s", {})})
    for b in billings:
        per = {label: {"c": s["cost_by_billing_gib_s"][b]} for label, s in summaries.items()
               if b in s.get("cost_by_billing_gib_s", {})}
        for name, other in (("megatron", meg), ("oracle", orc), ("eplb", eplb)):
            ours[f"cost_reduction_vs_{name}_{b}"] = versus(per, m, other, "c")
    return {"ours": ours, "paper": dict(PAPER)}


def default_specs(serverless, num_experts: int, num_devices: int, distance: int = 1) -> dict[str, SystemSpec]:
    """Every configured policy's system from a composed `serverless` config (`serverless.policies.<kind>`, each
    checked against that policy's settings); those that plan from forecasts get the configured forecast at
    `distance` (MoEless predicts `distance` layers ahead)."""
    forecast = ForecastKind.predictor if serverless.forecast.use_predictor else ForecastKind.history
    specs: dict[str, SystemSpec] = {}
    for kind, node in serverless.policies.items():
        settings = SERVERLESS.settings_from(node, where=f"serverless.policies.{kind}")
        uses_forecast = SERVERLESS.entry_for(settings).policy.uses_forecast
        specs[kind] = SystemSpec(settings, forecast, distance) if uses_forecast else SystemSpec(settings)
    return specs
