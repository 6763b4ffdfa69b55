"""Benchmark: MoEless vs Megatron-LM vs EPLB vs Oracle over several seeds, per model (mean ± std).

The same study as a Hydra multirun (any launcher, resumable, one wandb group), then its table:

    python -m engine.serve -m +experiment=serverless_seeds && python -m engine.report runs/serve/multirun/<folder>

    python engine/bench/bench_serverless_seeds.py [--seeds 0,1,2,3,4] [--models mixtral_8x7b,phi35_moe,llama4_scout]
        [--duration-s 30] [--workers 2] [--out runs/bench/serverless_seeds] [--fresh] [--set key=value ...]

(the multirun under joblib into `--out`, timed, then its report; a rerun resumes).

Each (model, seed) is one in-process `engine.serve` simulation (`mode=simulate`, the serve defaults: 8x A6000,
synthetic `domains` routing, the oracle forecasts as an upper bound at hit rate 0.9) of the Azure conversation
peak cut to `--duration-s`. A seed s sets `seed=s` (the traffic: which tokens go to which experts, and the
oracle forecasts' errors) and `routing.model_seed=s` (the synthetic model: which experts are popular in which
layer and domain), so seeds differ in both. Per model and system it writes the mean ± sample std (ddof = 1)
over seeds of the mean MoE-layer latency with and without copy waits, the cost (memory held x time, and
pay-per-use), the weight copies and the warm-start rate, and MoEless's relative change against every other
system (computed per seed, then mean ± std): `python -m engine.report <folder>` writes it into report.md (and
summary.json). The cores are shared: wall times are those of this machine under its load at the time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conf import compose  # noqa: E402  (the repository on the path first: run as a script)

MODELS = ("mixtral_8x7b", "phi35_moe", "llama4_scout")
SYSTEMS = ("static_ep", "eplb", "oracle", "moeless")  # serve's policy kinds, in table order
NAMES = {"static_ep": "Megatron-LM", "eplb": "EPLB", "oracle": "Oracle (lossy)", "moeless": "MoEless"}
# column -> (summary key, sub-key or None): what each system's results.json summary gives per run
METRICS = {
    "latency_ms": ("mean_moe_ms", None),  # mean MoE layer, copy waits included (the headline)
    "exec_ms": ("mean_moe_exec_ms", None),  # without the copy waits
    "cost_held_gib_s": ("cost_by_billing_gib_s", "held"),
    "cost_ppu_gib_s": ("cost_by_billing_gib_s", "pay_per_use"),
    "copies": ("copies", None),
    "warm_start_rate": ("warm_start_rate", None),
    "misc_ms": ("mean_misc_ms", None),  # the attention block beside each MoE layer (not tabled)
}
HEADERS = {"latency_ms": "MoE layer ms (copy waits incl.)", "exec_ms": "ms without copy waits",
           "cost_held_gib_s": "cost GiB·s (held)", "cost_ppu_gib_s": "cost GiB·s (pay-per-use)",
           "copies": "weight copies", "warm_start_rate": "warm-start rate"}
TABLED = tuple(HEADERS)
RELATIVE = ("latency_ms", "exec_ms", "cost_held_gib_s", "cost_ppu_gib_s")  # MoEless / other - 1, per seed


def serve_overrides(model: str, seed: int, duration_s: float, extra: Iterable[str] = ()) -> list[str]:
    """The `engine.serve` overrides of one seeded run (no figures, no wandb)."""
    return [f"model={model}", f"seed={seed}", f"routing.model_seed={seed}", f"workload.azure.duration_s={duration_s:g}",
            "plots=false", "wandb.mode=disabled", *extra]


def system_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The table's metrics from one system's results.json summary."""
    return {column: float(summary[key] if sub is None else summary[key][sub]) for column, (key, sub) in METRICS.items()}


def simulate(overrides: list[str], run_dir: Optional[Path] = None) -> dict[str, Any]:
    """One in-process `engine.serve` run: per system kind its metrics, plus what the run was and cost."""
    from engine.serve import run  # why lazy: jax comes with it; worker processes import it themselves

    t0 = time.perf_counter()
    results = run(compose("serve", overrides), run_dir=run_dir)
    return {"overrides": overrides, "wall_s": time.perf_counter() - t0, **run_summary(results)}


def run_summary(results: dict[str, Any]) -> dict[str, Any]:
    """What the serverless studies read of one `engine.serve` simulation's results.json: per system kind its
    metrics, the copy cost model and EPLB's rearrangements per layer."""
    systems = results["experiments"]["compare"]["systems"]
    layers = len(next(iter(results["experiments"]["compare"]["balancedness_per_layer"].values())))
    return {"model": results["model"], "iterations": results["iterations"],
            "steps_simulated": results["steps_simulated"], "routing_statistics": results["routing_statistics"],
            "layers": layers, "cost_model": results["cost_model"],
            "eplb_rearrangements_per_layer": sum(s["eplb_rebalances"] for s in systems.values()
                                                 if s["kind"] == "eplb") / layers,
            "systems": {s["kind"]: system_metrics(s) for s in systems.values()}}


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single value)."""
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model: per system and metric the (mean, std) over its seeds, and MoEless's relative change
    against each other system (MoEless / other - 1 per seed, then mean, std)."""
    out: dict[str, Any] = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        kinds = [k for k in SYSTEMS if all(k in r["systems"] for r in mine)]
        block: dict[str, Any] = {"seeds": [r["seed"] for r in mine], "wall_s": [r["wall_s"] for r in mine],
                                 "systems": {}, "moeless_vs": {}}
        for kind in kinds:
            metrics = [m for m in METRICS if all(m in r["systems"][kind] for r in mine)]  # older rows: fewer
            block["systems"][kind] = {m: mean_std([r["systems"][kind][m] for r in mine]) for m in metrics}
        if "moeless" in kinds:
            for kind in kinds:
                if kind != "moeless":
                    block["moeless_vs"][kind] = {m: mean_std([r["systems"]["moeless"][m] / r["systems"][kind][m] - 1
                                                              for r in mine]) for m in RELATIVE}
        out[model] = block
    return out


def fmt(mean: float, std: float) -> str:
    """mean ± std, 4 significant digits for the mean, 2 for the std."""
    return f"{mean:.4g} ± {std:.2g}"


def pct(mean: float, std: float) -> str:
    """A relative change as a percentage, or as a ratio (x) once it is more than doubling."""
    # no ± for a single run (or a constant)
    if mean >= 1:
        return f"x{1 + mean:.1f}" + (f" ± {std:.1f}" if std else "")
    return f"{100 * mean:+.1f} %" + (f" ± {100 * std:.1f}" if std else "")


def markdown(summary: dict[str, Any]) -> str:
    """The seed table (per model: systems x metrics, mean ± std) and MoEless's relative changes."""
    lines = []
    for model, block in summary.items():
        n = len(block["seeds"])
        lines += [f"**{model}** ({n} seeds: {', '.join(map(str, block['seeds']))}; mean ± std over seeds)", "",
                  "| system | " + " | ".join(HEADERS[m] for m in TABLED) + " |",
                  "| --- |" + " --- |" * len(TABLED)]
        for kind, stats in block["systems"].items():
            lines.append(f"| {NAMES[kind]} | " + " | ".join(fmt(*stats[m]) for m in TABLED) + " |")
        if block["moeless_vs"]:
            lines += ["", "| MoEless vs (change, or xratio) | latency (copy waits incl.) | latency without copy waits "
                      "| cost (held) | cost (pay-per-use) |", "| --- | --- | --- | --- | --- |"]
            for kind, rel in block["moeless_vs"].items():
                lines.append(f"| {NAMES[kind]} | " + " | ".join(pct(*rel[m]) for m in RELATIVE) + " |")
        lines.append("")
    return "\n".join(lines)


def seed_jobs(models: list[str], seeds: list[int], duration_s: float, extra: list[str], out: Optional[Path]
              ) -> list[tuple[list[str], Optional[str], dict[str, Any]]]:
    return [(serve_overrides(m, s, duration_s, extra), str(out / "runs" / f"{m}_seed{s}") if out else None,
             {"seed": s}) for m in models for s in seeds]


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--duration-s", type=float, default=30.0, help="seconds of the Azure peak replayed")
    ap.add_argument("--workers", type=int, default=2, help="parallel jobs (hydra.launcher.n_jobs)")
    ap.add_argument("--out", default="runs/bench/serverless_seeds", help="the multirun folder (a rerun resumes it)")
    ap.add_argument("--fresh", action="store_true", help="rerun every job, even those complete in --out")
    ap.add_argument("--set", action="append", default=[], help="extra engine.serve override (repeatable)")
    args = ap.parse_args(argv)
    from engine.bench.bench_simulate_sweep import multirun  # why lazy: the timer's helper only
    from engine.report import build

    out = Path(args.out).resolve()
    wall = multirun("serverless_seeds", out, args.workers, [f"model={args.models}", f"seed={args.seeds}",
                                                           f"workload.azure.duration_s={args.duration_s:g}", *args.set],
                    args.fresh, entry="engine.serve")
    path = build(out)
    print(path.read_text())
    print(f"wall {wall:.1f} s with {args.workers} joblib worker(s) (Hydra start included) -> {out}")


if __name__ == "__main__":
    main()
