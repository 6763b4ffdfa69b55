"""Planning time per MoE layer in the simulator, against the time a GPU spends on an in-memory MoE layer.

    python engine/bench/bench_planning.py [--points mixtral_8x7b:64,qwen3_30b_a3b:8] [--systems presched,horizon]
        [--machine a100_pcie4] [--gen-len 16] [--repeats 3]

For each point (model:batch) every system replays the same synthetic routing (Figure-11 settings: prompt 512,
transition-table forecasts) for `--gen-len` decode steps; `scheduler.plan` is timed with `perf_counter` around every
call (the forecasts it reads are made inside it, so the predictor's time is part of it, as in the executor's
`planning_ms`). The systems alternate round by round (`--repeats`), so a loaded machine slows them alike; printed:
median and p99 over the decode layers of all rounds.

The budget: one decode MoE layer of the model with every expert in GPU memory, from the cost model of `--machine`
(attention at the prompt's context, the shared experts, the routed experts active at that batch in one device call;
the routed experts' tokens from the same synthetic routing), at batch 1 and 64. A plan that takes longer than that
layer costs more than the layer itself would on a GPU that held the model; an offloaded layer (transfers, CPU
experts) is longer, so the plan is paid for only where it saves more than it costs.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from engine.bench.bench_horizon_study import Point, point_spec  # noqa: E402
from engine.bench.bench_simulate_sweep import scheduler_settings  # noqa: E402
from engine.sim.run import PreparedRouting, RunSpec, build_sim, prepare_routing  # noqa: E402
from schedulers.base import LayerPlan, LayerState, Phase  # noqa: E402
from schedulers.cost import CostModel  # noqa: E402


def timed_run(spec: RunSpec, routing: PreparedRouting) -> tuple[list[float], list[LayerPlan]]:
    """(seconds of every decode `plan` call, every plan in order) of one simulated run."""
    sim, _, _ = build_sim(spec, routing)
    plan = sim.scheduler.plan
    seconds: list[float] = []
    plans: list[LayerPlan] = []

    def timed(state: LayerState) -> LayerPlan:
        t0 = time.perf_counter()
        out = plan(state)
        if state.phase is Phase.decode:
            seconds.append(time.perf_counter() - t0)
        plans.append(out)
        return out

    sim.scheduler.plan = timed  # type: ignore[method-assign]
    sim.run(routing.passes)
    return seconds, plans


def point_run_spec(model: str, batch: int, machine: str, system: str, gen_len: int, seed: int = 0) -> RunSpec:
    """The study's spec of a point (transition forecasts) under `system`, `gen_len` decode steps."""
    spec = point_spec(Point("sweep", model, machine, batch), seed)
    return replace(spec, scheduler=scheduler_settings(system), gen_len=gen_len)


def gpu_layer_s(model: str, batch: int, machine: str, roofline: bool = False) -> float:
    """Seconds of one decode MoE layer with every expert in GPU memory (mean over the routing's decode layers).
    `roofline`: without the profile's per-call overheads (the paper's PyTorch dispatch, fitted at 1.1 ms a call on
    LayerScope's machines): what the same layer takes where the calls cost nothing but their FLOPs and bytes."""
    spec = point_run_spec(model, batch, machine, "presched", gen_len=4)
    routing = prepare_routing(spec)
    cost = CostModel(spec.model, spec.hardware, model_name=model)
    if roofline:
        cost.gpu_overhead_s = cost.call_overhead_s = 0.0
    times = []
    for fp in routing.passes:
        if fp.prefill:
            continue
        t_attn = cost.t_attn(fp.num_seqs, fp.context_len)
        for loads in fp.loads:
            live = loads[loads > 0]
            times.append(t_attn + cost.t_shared(fp.tokens) + float(np.sum(cost.t_g_group(live))))
    return float(np.mean(times))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="mixtral_8x7b:64,qwen3_30b_a3b:8")
    ap.add_argument("--systems", default="presched,horizon")
    ap.add_argument("--machine", default="a100_pcie4")
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    points = [(p.split(":")[0], int(p.split(":")[1])) for p in args.points.split(",")]
    systems = args.systems.split(",")
    out: dict[str, Any] = {}
    for model, batch in points:
        specs = {s: point_run_spec(model, batch, args.machine, s, args.gen_len) for s in systems}
        routings: dict[int, PreparedRouting] = {}
        seconds: dict[str, list[float]] = {s: [] for s in systems}
        for _ in range(args.repeats):
            for s in systems:
                spec = specs[s]
                routing = routings.setdefault(spec.sequences, prepare_routing(spec))
                seconds[s] += timed_run(spec, routing)[0]
        for s in systems:
            us = np.asarray(seconds[s]) * 1e6
            out[f"{model} b{batch} {s}"] = (float(np.median(us)), float(np.percentile(us, 99)), us.size)
            print(f"{model} b{batch} {args.machine} {s:>9}: plan per decode layer median {np.median(us):8.0f} us, "
                  f"p99 {np.percentile(us, 99):8.0f} us ({us.size} layers)")
    for model in dict(points):
        for batch in (1, 64):
            t, r = gpu_layer_s(model, batch, args.machine), gpu_layer_s(model, batch, args.machine, roofline=True)
            out[f"{model} gpu layer b{batch}"] = (t, r)
            print(f"budget: {model} {args.machine} in-memory decode MoE layer at batch {batch}: {t * 1e6:8.0f} us as "
                  f"the profile has it (per-call overheads fitted to the paper's PyTorch), {r * 1e6:6.0f} us at the "
                  "roofline")
    return out


if __name__ == "__main__":
    main()
