"""Benchmark: the latency-memory frontier of expert replication, every system and setting a point.

    python engine/bench/bench_serverless_frontier.py [--seeds 0,1,2,3,4] [--models mixtral_8x7b,phi35_moe,llama4_scout]
        [--duration-s 2] [--workers 2] [--out runs/bench/serverless_frontier] [--set key=value ...]

Each (model, seed) is one in-process `engine.serve experiments=[frontier]` simulation (8x A6000, the physical
`roofline` layer time of the offload simulator's CostModel, synthetic `domains` routing, oracle forecasts at
hit rate 0.9: an upper bound on a predictor) of the Azure conversation peak cut to `--duration-s`; seed s sets
`seed=s` and `routing.model_seed=s`. Every point of `engine.serverless.experiments.FRONTIER` gives its mean
MoE-layer latency (copy waits included) and the GPU expert memory it holds (time-averaged over the layers'
run time, kept-alive replicas included); per model `--out`/<model>.md holds mean ± sample std over the seeds
and `--out`/<model>.png the frontier. `frontier_rows` / `frontier_table` build them from results.json
summaries (importable for other drivers, e.g. a Hydra multirun over the same points).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conf import compose  # noqa: E402  (the repository on the path first: run as a script)

MODELS = ("mixtral_8x7b", "phi35_moe", "llama4_scout")
COLUMNS = {"latency_ms": "mean_moe_ms", "exec_ms": "mean_moe_exec_ms", "held_gib": "held_memory_time_avg_gib",
           "copies": "copies", "warm_start_rate": "warm_start_rate"}


def overrides(model: str, seed: int, duration_s: float, extra: Iterable[str] = ()) -> list[str]:
    return [f"model={model}", f"seed={seed}", f"routing.model_seed={seed}", f"workload.azure.duration_s={duration_s:g}",
            "experiments=[frontier]", "plots=false", "wandb.mode=disabled", *extra]


def run_point(args: tuple[str, int, float, list[str], str]) -> dict[str, Any]:
    """One (model, seed): every frontier system's columns (its engine.serve run folder under `out`)."""
    from engine.serve import run  # why lazy: jax comes with it; each worker imports it itself

    model, seed, duration, extra, out = args
    t0 = time.perf_counter()
    results = run(compose("serve", overrides(model, seed, duration, extra)), run_dir=Path(out) / f"{model}_s{seed}")
    systems = results["experiments"]["frontier"]["systems"]
    return {"model": model, "seed": seed, "wall_s": time.perf_counter() - t0, "iterations": results["iterations"],
            "cost_model": results["cost_model"],
            "systems": {label: {c: float(s[k]) for c, k in COLUMNS.items()} for label, s in systems.items()}}


def frontier_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per system: mean and sample std (ddof 1) over the runs of every column, in FRONTIER's order."""
    labels = list(runs[0]["systems"])
    rows = []
    for label in labels:
        row: dict[str, Any] = {"system": label, "seeds": len(runs)}
        for c in COLUMNS:
            v = np.array([r["systems"][label][c] for r in runs])
            row[c] = float(v.mean())
            row[c + "_std"] = float(v.std(ddof=1)) if v.size > 1 else 0.0
        rows.append(row)
    return rows


def frontier_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: latency, latency without copy waits, memory held, copies, warm starts; vs the best EPLB."""
    eplb = [r for r in rows if r["system"].startswith("EPLB")]
    best = min(eplb, key=lambda r: r["latency_ms"]) if eplb else None
    lines = ["| system | MoE layer ms (copy waits incl.) | ms without copy waits | GPU expert memory held GiB | "
             f"weight copies after the load | warm-start rate | vs {best['system'] if best else 'EPLB'} latency |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        rel = f"{(r['latency_ms'] / best['latency_ms'] - 1) * 100:+.1f} %" if best else ""
        lines.append(f"| {r['system']} | {r['latency_ms']:.4g} ± {r['latency_ms_std']:.2g} | {r['exec_ms']:.4g} ± "
                     f"{r['exec_ms_std']:.2g} | {r['held_gib']:.1f} ± {r['held_gib_std']:.2g} | {r['copies']:.3g} | "
                     f"{r['warm_start_rate']:.3f} | {rel} |")
    return "\n".join(lines)


def frontier_figure(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.errorbar(r["held_gib"], r["latency_ms"], xerr=r["held_gib_std"], yerr=r["latency_ms_std"], fmt="o",
                    capsize=3, label=r["system"])
    ax.set_xlabel("GPU expert memory held (GiB, time-averaged)")
    ax.set_ylabel("mean MoE-layer latency, copy waits incl. (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--duration-s", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="runs/bench/serverless_frontier")
    ap.add_argument("--set", action="append", default=[], help="extra engine.serve override (repeatable)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(m, int(s), a.duration_s, a.set, str(out)) for m in a.models.split(",") for s in a.seeds.split(",")]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=a.workers) as pool, open(out / "runs.jsonl", "w") as f:
        runs = []
        for r in pool.map(run_point, jobs):
            runs.append(r)
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(f"{r['model']} seed {r['seed']}: {r['wall_s']:.0f} s", flush=True)
    for model in a.models.split(","):
        rows = frontier_rows([r for r in runs if r["model"] == model])
        (out / f"{model}.md").write_text(frontier_table(rows) + "\n")
        frontier_figure(rows, f"{model}, 8x A6000, {a.duration_s:g}-s Azure peak", out / f"{model}.png")
        print(f"\n{model}\n{frontier_table(rows)}")
    print(f"\nwall {time.perf_counter() - t0:.0f} s ({a.workers} workers)")


if __name__ == "__main__":
    main()
