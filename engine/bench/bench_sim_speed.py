"""Benchmark: the offload simulator's own speed on study points, and whether two source trees give the same numbers.

Times `simulate` (every listed policy) and `lower_bound` at a few points of the Horizon study (`bench_horizon_study`:
transition-table forecasts, the Figure-11 settings) in CPU seconds, and records each run's throughput, total time and
bound as exact float reprs. With `--baseline-tree DIR` (another checkout, e.g. `git archive <commit> | tar -x -C DIR`)
the same work runs in that tree too, the two alternated round by round in fresh subprocesses, and the bench prints
the speed ratio per point and whether every number is bit-identical (a speed-up must not move a single result):

    python engine/bench/bench_sim_speed.py [--points qwen3_30b_a3b:a100_pcie4:64,...] [--systems horizon,presched]
        [--gen-len 64] [--rounds 2] [--baseline-tree /tmp/base]

Measured under load on a shared machine: compare the ratios of one run, not absolute seconds between runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_POINTS = "mixtral_8x7b:a100_pcie4:64,qwen3_30b_a3b:a100_pcie4:16,deepseek_v2_lite:v100_pcie3:8," \
                 "moonlight_16b_a3b:a100_pcie4:4"
DEFAULT_SYSTEMS = "horizon,presched,hybrimoe,klotski,dali,layerwise,fiddler,fate,ktransformers,ondemand,lru"


def measure(points: list[str], systems: list[str], gen_len: int, seed: int) -> list[dict[str, Any]]:
    """Every system at every point (one routing per in-flight width, as the study runs them): CPU seconds and the
    results as exact reprs."""
    sys.path.insert(0, str(Path.cwd()))
    from engine.bench.bench_horizon_study import Point, point_spec
    from engine.bench.bench_simulate_sweep import scheduler_settings
    from engine.sim.bounds import lower_bound
    from engine.sim.run import prepare_routing, simulate

    rows = []
    for text in points:
        model, machine, batch = text.split(":")
        base = replace(point_spec(Point("sweep", model, machine, int(batch)), seed), gen_len=gen_len)
        routings: dict[int, Any] = {}
        bounds: dict[int, tuple[float, float]] = {}
        for system in systems:
            spec = replace(base, scheduler=scheduler_settings(system))
            routing = routings.setdefault(spec.sequences, prepare_routing(spec))
            t0 = time.process_time()
            try:
                out = simulate(spec, routing)
            except ValueError as err:
                rows.append({"point": text, "system": system, "error": str(err)})
                continue
            t1 = time.process_time()
            bound_s = 0.0  # the bound's CPU time on the run that computed it (one per in-flight width)
            if spec.sequences not in bounds:
                lb = lower_bound(spec.model, out.cost, routing.passes, out.memory.cache_slots + spec.scheduler.staging_slots)
                bound_s = time.process_time() - t1
                bounds[spec.sequences] = (lb, bound_s)
            rows.append({"point": text, "system": system, "sim_s": t1 - t0, "bound_s": bound_s,
                         "tok_s": repr(out.summary["throughput_tok_s"]), "total_s": repr(out.summary["total_s"]),
                         "lower_bound_s": repr(bounds[spec.sequences][0])})
    return rows


def run_tree(tree: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """`measure` in a fresh interpreter whose imports come from `tree`."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--points", args.points, "--systems", args.systems,
           "--gen-len", str(args.gen_len), "--seed", str(args.seed)]
    out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{tree}: the measuring subprocess failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=DEFAULT_POINTS, help="model:machine:batch,... (sweep points)")
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--baseline-tree", default="", help="another checkout to time and compare against")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args.points.split(","), args.systems.split(","), args.gen_len, args.seed)))
        return
    trees = {"this": ROOT} | ({"baseline": Path(args.baseline_tree).resolve()} if args.baseline_tree else {})
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():  # alternated round by round
            runs[name].append(run_tree(tree, args))
    key = lambda r: (r["point"], r["system"])  # noqa: E731
    best = {name: {} for name in trees}
    for name, rounds in runs.items():
        for rows in rounds:
            for r in rows:
                old = best[name].get(key(r))
                if old is None or r.get("sim_s", 0) < old.get("sim_s", 0):
                    best[name][key(r)] = r
    print("| point | system | tok/s | sim CPU s (this) | bound CPU s (this) |"
          + (" sim CPU s (baseline) | speed-up | identical |" if len(trees) > 1 else ""))
    print("|---|---|---|---|---|" + ("---|---|---|" if len(trees) > 1 else ""))
    same_all, totals = True, {name: 0.0 for name in trees}
    for k, r in best["this"].items():
        if "error" in r:
            print(f"| {k[0]} | {k[1]} | {r['error'][:60]} | | |")
            continue
        line = f"| {k[0]} | {k[1]} | {float(r['tok_s']):.4f} | {r['sim_s']:.2f} | {r['bound_s']:.2f} |"
        totals["this"] += r["sim_s"] + r["bound_s"]
        if len(trees) > 1:
            b = best["baseline"][k]
            same = all(r[f] == b[f] for f in ("tok_s", "total_s", "lower_bound_s"))
            same_all &= same
            totals["baseline"] += b["sim_s"] + b["bound_s"]
            line += f" {b['sim_s']:.2f} | {b['sim_s'] / max(r['sim_s'], 1e-9):.2f}x | {'yes' if same else '**no**'} |"
        print(line)
    print(f"CPU seconds (simulate + the bounds, best of {args.rounds} round(s)): "
          + ", ".join(f"{name} {t:.1f}" for name, t in totals.items())
          + (f"; speed-up {totals['baseline'] / max(totals['this'], 1e-9):.2f}x; every result bit-identical: "
             f"{'yes' if same_all else 'NO'}" if len(trees) > 1 else ""))


if __name__ == "__main__":
    main()
