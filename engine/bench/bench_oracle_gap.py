"""Distance to optimal on small instances: every system's decode pass against the exact best
schedule (engine.sim.bounds.exact_best_pass) and the lower bound.

Instances: Mixtral-8x7B shapes cut to `--layers` MoE layers, a few sequences, a cache of
`--cache` experts (the hot table from profiling traffic), synthetic routing, one decode pass from a
cold link. The exact search covers LayerScope's action space with the same hot table as PreSched (CPU/GPU
split of the missing experts, prefetches into the dynamic region): a system with another action
space (HybriMoE's per-layer slots, layerwise running resident experts on the CPU) can beat it, so
gaps are also given against the best schedule known (min of the exact search and every system).

    python engine/bench/bench_oracle_gap.py [--instances 8] [--layers 3] [--batch 3] [--cache 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from conf import compose  # noqa: E402  (the repository on the path first: run as a script)
from engine.sim.bounds import exact_best_pass, lower_bound  # noqa: E402
from engine.sim.run import RunSpec, build_sim, prepare_routing  # noqa: E402
from models.loading import resolve_model_config  # noqa: E402
from schedulers.base import OFFLOAD, SchedulerSettings  # noqa: E402
from schedulers.hardware import load_hardware  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--cache", type=int, default=8)
    ap.add_argument("--hardware", default="v100_pcie3")
    ap.add_argument("--model", default="mixtral_8x7b")
    args = ap.parse_args()

    full = resolve_model_config(compose("simulate", [f"model={args.model}"]).model)
    first_moe = full.moe_layers[0]
    cfg = full.replace(num_hidden_layers=first_moe + args.layers)
    hw = load_hardware(args.hardware)
    # the bound is the exact model's: a policy that changes the output (speculation) is not measured against it
    kinds = [k for k in OFFLOAD.names() if getattr(OFFLOAD.get(k).settings, "exact_output", True)]
    gaps: dict[str, list[float]] = {k: [] for k in kinds}
    known: dict[str, list[float]] = {k: [] for k in kinds}
    lb_gap: list[float] = []
    t0 = time.perf_counter()
    for seed in range(args.instances):
        spec = RunSpec(model=cfg, model_name=f"{args.model}-{args.layers}l", hardware=hw, scheduler=SchedulerSettings(),
                       batch_size=args.batch, prompt_len=8, gen_len=2, seed=seed, cache_slots=args.cache,
                       profile_batches=2)
        prepared = prepare_routing(spec)
        fp = next(p for p in prepared.passes if not p.prefill)
        times = {}
        for kind in kinds:
            settings = OFFLOAD.get(kind).settings(label=kind, dynamic_slots=max(args.cache // 3, 1))
            sim, mem, cost = build_sim(spec.with_scheduler(settings), prepared)
            times[kind] = sim.run_pass(fp)
            if kind == "presched":
                pinned, start = sim.scheduler.pinned, sim.scheduler.initial_residency()
                ps_cost = cost
        best, _ = exact_best_pass(cfg, ps_cost, prepared.trace, fp, pinned, args.cache, initial=start,
                                  upper_bound=times["presched"] * (1 + 1e-9) + 1e-12)
        best = min(best, times["presched"])
        lb = lower_bound(cfg, ps_cost, [fp], args.cache + 2)
        lb_gap.append(best / lb - 1)
        best_known = min(best, min(times.values()))
        for k, v in times.items():
            gaps[k].append(v / best - 1)
            known[k].append(v / best_known - 1)
        print(f"instance {seed}: exact {best * 1e3:.2f} ms, lower bound {lb * 1e3:.2f} ms, "
              + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in times.items()))
    print(f"\n{args.instances} instances ({args.model} shapes, {args.layers} MoE layers, batch {args.batch}, "
          f"cache {args.cache}) in {time.perf_counter() - t0:.1f} s")
    print("system          vs exact: mean     min      max   | vs best known: mean      max")
    for k, v in gaps.items():
        print(f"{k:15s} {100 * np.mean(v):14.1f}% {100 * np.min(v):7.1f}% {100 * np.max(v):7.1f}%  | "
              f"{100 * np.mean(known[k]):17.1f}% {100 * np.max(known[k]):7.1f}%")
    print(f"exact above lower bound: mean {100 * np.mean(lb_gap):.1f}%, max {100 * np.max(lb_gap):.1f}%")


if __name__ == "__main__":
    main()
