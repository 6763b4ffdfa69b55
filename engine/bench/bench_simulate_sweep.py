"""Benchmark: the whole LayerScope Figure-11 sweep in the simulator, timed.

4 models (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V2-Lite, Moonlight-16B-A3B) x 2 machines
(v100_pcie3, a100_pcie4) x 5 batch sizes (4..64, prompt 512, generate 64) x every offload system,
each (model, batch) routing generated once and replayed by every system on both machines.
Prints the wall and CPU time (the cores are shared: compare ratios within one run) and writes
`results.jsonl` + the report tables into `--out`.

    python engine/bench/bench_simulate_sweep.py [--workers 2] [--out runs/bench/sweep] [--ablation]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODELS = ["mixtral_8x7b", "qwen3_30b_a3b", "deepseek_v2_lite", "moonlight_16b_a3b"]
HARDWARE = ["v100_pcie3", "a100_pcie4"]
BATCHES = [4, 8, 16, 32, 64]
SYSTEMS = ["presched", "hybrimoe", "fiddler", "klotski", "fate", "ktransformers", "ondemand", "lru"]
ABLATION = ["presched", "presched_no_hot", "layerwise", "presched_no_predictor", "presched_no_async"]


@lru_cache(maxsize=None)
def scheduler_settings(name: str):
    """The `conf/scheduler/<name>.yaml` settings (`presched_no_async`: PreSched with synchronous copies).

    Cached per worker process: a Hydra compose costs ~0.3 s, more than most simulated runs."""
    from conf import compose
    from schedulers.base import scheduler_settings as from_config

    base = "presched" if name == "presched_no_async" else name
    settings = from_config(compose("simulate", [f"scheduler={base}"]).scheduler)
    if name == "presched_no_async":
        from dataclasses import replace

        settings = replace(settings, label="LayerScope w/o AsyncIO")
    return settings


@lru_cache(maxsize=None)
def hardware(name: str):
    """The `conf/hardware/<name>.yaml` profile (cached per worker process)."""
    from schedulers.hardware import load_hardware

    return load_hardware(name)


def run_group(args: tuple[str, int, list[str], str, bool, str, tuple[str, ...]]) -> list[dict[str, Any]]:
    """Every system on both machines for one (model, batch): one routing, many replays."""
    model, batch, systems, routing_name, bounds, routing_path, extra = args
    from dataclasses import replace

    from conf import compose
    from engine.sim.run import prepare_routing, simulate, spec_from_config

    overrides = [f"model={model}", f"batch_size={batch}", f"routing={routing_name}"]
    if routing_path:
        overrides.append(f"routing.path={routing_path}")
    overrides.extend(extra)
    cfg = compose("simulate", overrides)
    base = spec_from_config(cfg)
    if base.predictor_config is not None:  # validate the predictor node once, not once per run
        from predictors.config import predictor_config

        base = replace(base, predictor_config=predictor_config(base.predictor_config))
    t0 = time.process_time()
    routing = prepare_routing(base)
    t_routing = time.process_time() - t0
    rows = []
    for hw in HARDWARE:
        lb = None
        for system in systems:
            spec = replace(base, hardware=hardware(hw), scheduler=scheduler_settings(system),
                           async_io=system != "presched_no_async")
            t1 = time.process_time()
            out = simulate(spec, routing)
            row = {"model": spec.model_name, "hardware": hw, "batch_size": batch, "system": system,
                   "scheduler": spec.scheduler.label, "routing": routing_name, "sim_cpu_s": time.process_time() - t1,
                   "routing_cpu_s": t_routing if system == systems[0] and hw == HARDWARE[0] else 0.0}
            row.update({k: v for k, v in out.summary.items() if not isinstance(v, dict)})
            if bounds and spec.async_io:
                if lb is None:  # the bound does not depend on the schedule
                    from engine.sim.bounds import lower_bound

                    lb = lower_bound(spec.model, out.cost, routing.passes,
                                     out.memory.cache_slots + spec.scheduler.staging_slots)
                row["lower_bound_s"] = lb
                row["above_lower_bound"] = out.summary["total_s"] / lb - 1
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="runs/bench/simulate_sweep")
    ap.add_argument("--ablation", action="store_true", help="the Figure-13 ablation instead of the Figure-11 systems")
    ap.add_argument("--routing", default="synthetic", help="a conf/routing/ config name")
    ap.add_argument("--routing-path", default="", help="trace / jsonl file for --routing trace|jsonl")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra `simulate` override for every run, e.g. cache_slots=96 (repeatable)")
    ap.add_argument("--bounds", action="store_true", help="also compute the lower bound of every point (not timed)")
    args = ap.parse_args()
    systems = ABLATION if args.ablation else SYSTEMS
    groups = [(m, b, systems, args.routing, args.bounds, args.routing_path, tuple(args.set)) for m in args.models.split(",")
              for b in map(int, args.batches.split(","))]
    groups.sort(key=lambda g: -g[1])  # big batches first: better packing over the workers
    wall0, cpu0 = time.perf_counter(), time.process_time()
    rows: list[dict[str, Any]] = []
    if args.workers > 1:
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            for chunk in pool.map(run_group, groups):
                rows.extend(chunk)
    else:
        for g in groups:
            rows.extend(run_group(g))
    wall = time.perf_counter() - wall0
    cpu_children = sum(r["sim_cpu_s"] + r["routing_cpu_s"] for r in rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    from engine.report import write_report

    write_report(out, rows)
    n_runs = len(rows)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"sweep: {n_runs} simulated runs ({len(groups)} routings x {len(HARDWARE)} machines x {len(systems)} systems)")
    print(f"wall time {wall:.1f} s with {args.workers} worker(s); simulation CPU time {cpu_children:.1f} s "
          f"(routing {sum(r['routing_cpu_s'] for r in rows):.1f} s); 1-min load average at the end {load:.2f}")
    print(f"target: under 120 s wall on 2 cores -> {'met' if wall < 120 else 'NOT met'} ({wall / 120:.2f} of the budget)")
    print(f"tables and figures in {out}")


if __name__ == "__main__":
    main()
