"""The latency-memory frontier study's report: its engine.serve jobs' results.json into tables and figures.

A frontier job is one `engine.serve experiments=[frontier]` simulation (one model, one seed, one routing, one
forecast source; `conf/experiment/serverless_frontier.yaml`). Jobs are grouped by (model, routing); within a
group every system that plans from forecasts (MoEless) appears once per forecast source, labelled with it
(e.g. its own trained predictor beside the oracle, an upper bound), and every other system once. Per system:
mean ± sample std over the seeds of the MoE-layer latency (copy waits included), the same without copy waits,
the GPU expert memory held (time-averaged, kept-alive replicas included), weight copies after the load and the
warm-start rate, and the per-seed paired latency change against EPLB at vLLM's cadence and against static EP.
`python -m engine.report <folder>` calls `write_frontier_report`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import numpy as np

COLUMNS = {"latency_ms": "mean_moe_ms", "exec_ms": "mean_moe_exec_ms", "held_gib": "held_memory_time_avg_gib",
           "copies": "copies", "warm_start_rate": "warm_start_rate"}
REFERENCES = ("EPLB 3000/1000", "Megatron-LM")  # the paired changes' baselines: vLLM's EPLB cadence, static EP
FORECAST_KIND = "moeless"  # systems of this policy plan from forecasts; the others ignore the predictor


def is_frontier(results: dict[str, Any]) -> bool:
    """Whether a results.json is an engine.serve simulation with the frontier experiment."""
    return results.get("mode") == "simulate" and "frontier" in (results.get("experiments") or {})


def forecast_label(predictor: dict[str, Any]) -> str:
    """How MoEless's forecasts were made, for its rows' labels: the trained predictor by name and its measured
    hit rate at d = 1, or the oracle marked as an upper bound."""
    hit = predictor.get("hit_rate_by_distance", {}).get("1")
    rate = f", hit rate {hit:.3f}" if hit is not None else ""
    if predictor.get("upper_bound"):
        return f"oracle{rate}, upper bound"
    name = str(predictor.get("name", "?"))
    if predictor.get("checkpoint"):  # the trained folder names the predictor better than its kind
        name += " " + "/".join(Path(str(predictor["checkpoint"]).split(":")[-1]).parts[-2:])
    return f"{name} (trained{rate})"


def frontier_run(path: Path, results: dict[str, Any], seed: int, wall_s: float) -> dict[str, Any]:
    """One frontier job as a report row: its model, routing, forecast source, seed and every system's columns."""
    systems = results["experiments"]["frontier"]["systems"]
    return {"frontier": True, "model": results["model"], "routing": str(results.get("routing")), "seed": seed,
            "forecast": forecast_label(results.get("predictor", {})), "iterations": results.get("iterations"),
            "duration_s": results.get("workload", {}).get("duration_s"), "hardware": results.get("hardware"),
            "wall_s": wall_s, "job": str(path.parent),
            "systems": {label: {"kind": s.get("kind"), **{c: float(s[k]) for c, k in COLUMNS.items()}}
                        for label, s in systems.items()}}


def merged_by_seed(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The jobs of one (model, routing) merged per seed: systems planning from forecasts labelled with their
    forecast source when the group has more than one, every other system taken once (from the first job)."""
    sources = sorted({r["forecast"] for r in runs})
    merged: dict[int, dict[str, Any]] = {}
    for r in sorted(runs, key=lambda r: (r["seed"], sources.index(r["forecast"]))):
        seed_run = merged.setdefault(r["seed"], {"seed": r["seed"], "systems": {}})
        for label, s in r["systems"].items():
            if s.get("kind") == FORECAST_KIND and len(sources) > 1:
                label = f"{label} [{r['forecast']}]"
            seed_run["systems"].setdefault(label, s)
    return [merged[s] for s in sorted(merged)]


def frontier_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per system (first-seen order): mean and sample std (ddof 1) over the runs holding it of every column, and
    the paired latency change against each reference system present (mean ± std over the seeds)."""
    labels = list(dict.fromkeys(label for r in runs for label in r["systems"]))
    rows = []
    for label in labels:
        have = [r for r in runs if label in r["systems"]]
        row: dict[str, Any] = {"system": label, "seeds": len(have)}
        for c in COLUMNS:
            v = np.array([r["systems"][label][c] for r in have])
            row[c] = float(v.mean())
            row[c + "_std"] = float(v.std(ddof=1)) if v.size > 1 else 0.0
        for ref in REFERENCES:
            pairs = [r["systems"][label]["latency_ms"] / r["systems"][ref]["latency_ms"] - 1
                     for r in have if ref in r["systems"]]
            if pairs:
                row[f"vs {ref}"] = float(np.mean(pairs))
                row[f"vs {ref}_std"] = float(np.std(pairs, ddof=1)) if len(pairs) > 1 else 0.0
        rows.append(row)
    return rows


def _change(row: dict[str, Any], ref: str) -> str:
    if f"vs {ref}" not in row:
        return ""
    return f"{100 * row[f'vs {ref}']:+.1f} % ± {100 * row[f'vs {ref}_std']:.1f}"


def frontier_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: latency, latency without copy waits, memory held, copies, warm starts, the paired changes."""
    lines = ["| system | seeds | MoE layer ms (copy waits incl.) | ms without copy waits | GPU expert memory held GiB | "
             "weight copies after the load | warm-start rate | " + " | ".join(f"vs {ref} (paired)" for ref in REFERENCES)
             + " |", "| --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in REFERENCES) + " |"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['seeds']} | {r['latency_ms']:.4g} ± {r['latency_ms_std']:.2g} | "
                     f"{r['exec_ms']:.4g} ± {r['exec_ms_std']:.2g} | {r['held_gib']:.1f} ± {r['held_gib_std']:.2g} | "
                     f"{r['copies']:.3g} | {r['warm_start_rate']:.3f} | "
                     + " | ".join(_change(r, ref) for ref in REFERENCES) + " |")
    return "\n".join(lines)


def frontier_figure(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Every system as a point: memory held (x) against MoE-layer latency (y, log), with their seed stds."""
    import matplotlib  # why lazy: only the report draws
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in rows:
        ax.errorbar(r["held_gib"], r["latency_ms"], xerr=r["held_gib_std"], yerr=r["latency_ms_std"], fmt="o",
                    capsize=3, label=r["system"])
    ax.set_xlabel("GPU expert memory held (GiB, time-averaged)")
    ax.set_ylabel("mean MoE-layer latency, copy waits incl. (ms)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=5.5, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text).strip("_")[:80]


def write_frontier_report(out: Path, runs: list[dict[str, Any]], wall_s: float, launcher: str) -> Path:
    """report.md (one table per (model, routing)), a figure per group and summary.json into `out`."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[(r["model"], r["routing"])].append(r)
    out.mkdir(parents=True, exist_ok=True)
    text = ["# The latency-memory frontier of expert replication", "",
            f"{len(runs)} engine.serve frontier jobs in {wall_s:.0f} s wall under {launcher}. Mean ± sample std "
            "over the seeds; paired changes per seed. Oracle forecasts are an upper bound on a predictor.", ""]
    summary: dict[str, Any] = {}
    for (model, routing), group in sorted(groups.items()):
        rows = frontier_rows(merged_by_seed(group))
        first = group[0]
        sources = sorted({r["forecast"] for r in group})
        title = f"{model}, {first.get('hardware')}, {first.get('duration_s')}-s Azure peak, routing {routing}"
        name = _slug(f"{model}_{routing}")
        frontier_figure(rows, title, out / f"{name}.png")
        text += [f"## {title}", "",
                 f"Seeds {sorted({r['seed'] for r in group})}; {np.mean([r['iterations'] for r in group]):.0f} "
                 f"serving iterations a job; MoEless forecasts: {'; '.join(sources)}.", "",
                 frontier_table(rows), "", f"![{name}]({name}.png)", ""]
        summary[f"{model} | {routing}"] = rows
    (out / "frontier_summary.json").write_text(json.dumps(summary, indent=1))
    path = out / "report.md"
    path.write_text("\n".join(text))
    return path


def job_seed(path: Path, default: int = 0) -> int:
    """The seed of a Hydra job from its composed config (`.hydra/config.yaml` beside results.json)."""
    composed = path.parent / ".hydra" / "config.yaml"
    if not composed.is_file():
        return default
    from omegaconf import OmegaConf

    return int(OmegaConf.load(composed).seed)


def job_wall_s(path: Path) -> float:
    """Seconds a job ran (its job_complete.json), NaN without the marker."""
    from core.telemetry import JOB_COMPLETE

    marker = path.parent / JOB_COMPLETE
    done: Optional[dict] = json.loads(marker.read_text()) if marker.is_file() else None
    return done["finished"] - done["started"] if done else float("nan")
