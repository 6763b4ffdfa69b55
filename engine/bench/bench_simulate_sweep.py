"""Benchmark: the whole LayerScope Figure-11 sweep in the simulator, timed.

4 models (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V2-Lite, Moonlight-16B-A3B) x 2 machines
(v100_pcie3, a100_pcie4) x 5 batch sizes (4..64, prompt 512, generate 64) x every offload system,
each (model, batch) routing generated once and replayed by every system on both machines.
Prints the wall and CPU time (the cores are shared: compare ratios within one run) and writes the report tables
into `--out`. The sweep is the study multirun `python -m engine.simulate -m +experiment=fig11` (fig13_ablation,
hit_rate_sweep; `engine.studies`), run here under joblib with `--workers` jobs into `--out` (a rerun resumes it;
`--fresh` starts over); this script times it and sets its axes from the flags:

    python engine/bench/bench_simulate_sweep.py [--workers 2] [--out runs/bench/sweep] [--ablation]

`--hit-rates 0.3,0.5,0.7,measured,0.95,1.0` runs PreSched against the oracle's hit rate instead (the same hit
rate at every distance; `measured`: the default oracle, LLaPor's measured hit rate per distance), next to the
routing-only predictors run for real on the same routing and PreSched without forecasts, for `--models` x
`--batches` on both machines; `engine.report` turns it into the hit-rate table and figure:

    python engine/bench/bench_simulate_sweep.py --hit-rates 0.3,0.5,0.7,measured,0.95,1.0 \
        --models mixtral_8x7b,deepseek_v2_lite --batches 16 --out runs/bench/hit_rate_sweep
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conf import compose  # noqa: E402  (the repository on the path first: run as a script)
from engine.report import load_rows, write_report  # noqa: E402
from engine.sim.bounds import lower_bound  # noqa: E402
from engine.sim.run import RunSpec, default_predictor, prepare_routing, simulate  # noqa: E402
from predictors.config import PredictorConfig, PredictorKind, oracle_config  # noqa: E402
from engine.simulate import spec_from_config  # noqa: E402
from schedulers.base import scheduler_settings as from_config  # noqa: E402
from schedulers.hardware import load_hardware  # noqa: E402

MODELS = ["mixtral_8x7b", "qwen3_30b_a3b", "deepseek_v2_lite", "moonlight_16b_a3b"]
HARDWARE = ["v100_pcie3", "a100_pcie4"]
BATCHES = [4, 8, 16, 32, 64]
SYSTEMS = ["presched", "hybrimoe", "fiddler", "klotski", "fate", "ktransformers", "ondemand", "lru"]
ABLATION = ["presched", "presched_no_hot", "layerwise", "presched_no_predictor", "presched_no_async"]


@lru_cache(maxsize=None)
def scheduler_settings(name: str):
    """The `conf/scheduler/<name>.yaml` settings (`presched_no_async`: PreSched with synchronous copies).

    Cached per worker process: a Hydra compose costs more than most simulated runs."""
    base = "presched" if name == "presched_no_async" else name
    settings = from_config(compose("simulate", [f"scheduler={base}"]).scheduler)
    if name == "presched_no_async":
        settings = replace(settings, label="LayerScope w/o AsyncIO")
    return settings


@lru_cache(maxsize=None)
def hardware(name: str):
    """The `conf/hardware/<name>.yaml` profile (cached per worker process)."""
    return load_hardware(name)


def run_group(args: tuple[str, int, list[str], str, bool, str, tuple[str, ...]]) -> list[dict[str, Any]]:
    """Every system on both machines for one (model, batch): one routing, many replays."""
    model, batch, systems, routing_name, bounds, routing_path, extra = args
    overrides = [f"model={model}", f"batch_size={batch}", f"routing={routing_name}"]
    if routing_path:
        overrides.append(f"routing.path={routing_path}")
    overrides.extend(extra)
    return group_rows(spec_from_config(compose("simulate", overrides)), systems, HARDWARE, routing_name, bounds)


def group_rows(base: RunSpec, systems: Sequence[str], machines: Sequence[str], routing_name: str, bounds: bool
               ) -> list[dict[str, Any]]:
    """Every system on every machine for the base run's (model, batch, routing): one routing, many replays
    (a Figure-11 study job, `engine.studies`)."""
    t0 = time.process_time()
    routing = prepare_routing(base)
    t_routing = time.process_time() - t0
    rows = []
    extra_routing: dict[int, Any] = {}
    for hw in machines:
        lb = None
        for system in systems:
            spec = replace(base, hardware=hardware(hw), scheduler=scheduler_settings(system),
                           async_io=system != "presched_no_async")
            t1 = time.process_time()
            if spec.sequences != base.sequences:  # Klotski keeps two batches in flight: its own, larger routing
                if spec.sequences not in extra_routing:
                    extra_routing[spec.sequences] = prepare_routing(spec)
                out = simulate(spec, extra_routing[spec.sequences])
            else:
                out = simulate(spec, routing)
            row = {"model": spec.model_name, "hardware": hw, "batch_size": base.batch_size, "system": system,
                   "scheduler": spec.scheduler.label, "routing": routing_name, "seed": base.seed,
                   "sim_cpu_s": time.process_time() - t1,
                   "routing_cpu_s": t_routing if system == systems[0] and hw == machines[0] else 0.0}
            row.update({k: v for k, v in out.summary.items() if not isinstance(v, dict)})
            if bounds and spec.async_io and spec.sequences == base.sequences:
                if lb is None:  # the bound does not depend on the schedule
                    lb = lower_bound(spec.model, out.cost, routing.passes,
                                     out.memory.cache_slots + spec.scheduler.staging_slots)
                row["lower_bound_s"] = lb
                row["above_lower_bound"] = out.summary["total_s"] / lb - 1
            rows.append(row)
    return rows


HIT_RATES = "0.3,0.5,0.7,measured,0.95,1.0"
REAL_PREDICTORS = ("transition", "stats")  # routing-only: run for real on the replayed routing (fitted on held-out)


def sweep_predictor(point: str) -> PredictorConfig:
    """The forecasts of one hit-rate point: `measured` is the default oracle (LLaPor's measured hit rate per
    distance); a number is the oracle at that hit rate at every distance; a predictor kind runs that predictor."""
    if point == "measured":
        return default_predictor()
    if point in REAL_PREDICTORS:
        return PredictorConfig(name=point, kind=PredictorKind(point))
    try:
        h = float(point)
    except ValueError:
        h = -1.0
    if not 0.0 <= h <= 1.0:
        raise ValueError(f"--hit-rates: {point!r} is neither `measured`, a routing-only predictor "
                         f"({', '.join(REAL_PREDICTORS)}) nor a hit rate in [0, 1]")
    return oracle_config(hit_rate=h)


def run_hit_sweep(args: tuple[str, int, tuple[str, ...], str, str, tuple[str, ...], tuple[str, ...]]
                  ) -> list[dict[str, Any]]:
    """PreSched at every hit-rate point, with the real routing-only predictors and without forecasts, on both
    machines for one (model, batch): one routing, many replays. Rows carry `hit_sweep` (the point)."""
    model, batch, points, routing_name, routing_path, extra, machines = args
    overrides = [f"model={model}", f"batch_size={batch}", f"routing={routing_name}", "scheduler=presched", *extra]
    if routing_path:
        overrides.append(f"routing.path={routing_path}")
    return hit_rows(spec_from_config(compose("simulate", overrides)), points, machines, routing_name)


def hit_rows(base: RunSpec, points: Sequence[str], machines: Sequence[str], routing_name: str) -> list[dict[str, Any]]:
    """PreSched (the base run's scheduler) at every hit-rate point, with the real routing-only predictors and
    without forecasts, on every machine: one routing, many replays (a hit-rate study job, `engine.studies`)."""
    routing = prepare_routing(base)
    rows = []
    for hw in machines:
        for point in dict.fromkeys((*points, *REAL_PREDICTORS, "none")):  # each once, in order
            pred = None if point == "none" else sweep_predictor(point)
            settings = scheduler_settings("presched_no_predictor") if point == "none" else base.scheduler
            spec = replace(base, hardware=hardware(hw), scheduler=settings, predictor=pred)
            t1 = time.process_time()
            out = simulate(spec, routing)
            oracle = pred is not None and pred.kind is PredictorKind.oracle
            row = {"model": spec.model_name, "hardware": hw, "batch_size": base.batch_size, "system": "presched",
                   "scheduler": spec.scheduler.label, "routing": routing_name, "seed": base.seed,
                   "sim_cpu_s": time.process_time() - t1,
                   "hit_sweep": point, "predictor_kind": "none" if pred is None else
                   ("oracle (upper bound)" if oracle else pred.kind.value),
                   "oracle_hit_rate": pred.oracle.at(1) if oracle else None,
                   "predictor_hit_rate_source": (pred.oracle.provenance() if oracle else
                                                 None if pred is None else "measured in this run")}
            row.update({k: v for k, v in out.summary.items() if not isinstance(v, dict)})
            rows.append(row)
    return rows


def multirun(experiment: str, out: Path, workers: int, overrides: Sequence[str], fresh: bool,
             entry: str = "engine.simulate") -> float:
    """`python -m <entry> -m +experiment=<experiment>` into `out` under joblib with `workers` jobs (wandb off: a
    timed bench); the wall seconds it took. Jobs already complete in `out` are skipped (resume) unless `fresh`."""
    if fresh and out.is_dir():
        for job in out.glob("*/job_complete.json"):
            job.unlink()
    cmd = [sys.executable, "-m", entry, "-m", f"+experiment={experiment}", f"hydra.sweep.dir={out}",
           "hydra/launcher=joblib", f"hydra.launcher.n_jobs={workers}", "wandb.mode=disabled", *overrides]
    wall0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (exit status {proc.returncode})")
    return time.perf_counter() - wall0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="parallel jobs (hydra.launcher.n_jobs)")
    ap.add_argument("--out", default="runs/bench/simulate_sweep", help="the multirun folder (a rerun resumes it)")
    ap.add_argument("--fresh", action="store_true", help="rerun every job, even those complete in --out")
    ap.add_argument("--ablation", action="store_true", help="the Figure-13 ablation instead of the Figure-11 systems")
    ap.add_argument("--routing", default="synthetic", help="a conf/routing/ config name")
    ap.add_argument("--routing-path", default="", help="trace / jsonl file for --routing trace|jsonl")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default=",".join(map(str, sorted(BATCHES, reverse=True))))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra `simulate` override for every run, e.g. cache_slots=96 (repeatable)")
    ap.add_argument("--bounds", action="store_true", help="also compute the lower bound of every point (not timed)")
    ap.add_argument("--hit-rates", default="", metavar="POINTS",
                    help=f"PreSched vs the oracle's hit rate instead, e.g. {HIT_RATES} (see the module docstring)")
    args = ap.parse_args()
    overrides = [f"model={args.models}", f"batch_size={args.batches}", f"routing={args.routing}", *args.set]
    if args.routing_path:
        overrides.append(f"routing.path={args.routing_path}")
    if args.hit_rates:
        points = [p.strip() for p in args.hit_rates.split(",") if p.strip()]
        for p in points:
            sweep_predictor(p)  # a bad point fails before any run
        experiment = "hit_rate_sweep"
        overrides.append("study.hit_rates=[" + ",".join(f"'{p}'" for p in points) + "]")
    else:
        experiment = "fig13_ablation" if args.ablation else "fig11"
        overrides.append(f"bounds.lower_bound={str(args.bounds).lower()}")
    out = Path(args.out).resolve()
    wall = multirun(experiment, out, args.workers, overrides, args.fresh)
    rows = load_rows(out)
    write_report(out, rows)
    jobs = len(list(out.glob("*/job_complete.json")))
    cpu = sum(r["sim_cpu_s"] + r.get("routing_cpu_s", 0.0) for r in rows)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"sweep: {len(rows)} simulated runs in {jobs} jobs (+experiment={experiment}: one routing per job, "
          f"replayed by every system / forecast on {len(HARDWARE)} machines)")
    print(f"wall time {wall:.1f} s with {args.workers} joblib worker(s), Hydra start included; simulation CPU time "
          f"{cpu:.1f} s (routing {sum(r.get('routing_cpu_s', 0.0) for r in rows):.1f} s); 1-min load average at "
          f"the end {load:.2f}")
    print(f"target: under 120 s wall on 2 cores -> {'met' if wall < 120 else 'NOT met'} ({wall / 120:.2f} of the budget)")
    print(f"tables and figures in {out}")


if __name__ == "__main__":
    main()
