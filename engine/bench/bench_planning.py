"""Planning time per MoE layer in the simulator, against the time a GPU spends on an in-memory MoE layer.

    python engine/bench/bench_planning.py [--points mixtral_8x7b:64,qwen3_30b_a3b:8] [--systems presched,horizon]
        [--machine a100_pcie4] [--gen-len 16] [--repeats 3] [--base <git commit>] [--profile]

For each point (model:batch) every system replays the same synthetic routing (Figure-11 settings: prompt 512,
transition-table forecasts) for `--gen-len` decode steps; `scheduler.plan` is timed with `perf_counter` around every
call (the forecasts it reads are made inside it, so the predictor's time is part of it, as in the executor's
`planning_ms`). The systems alternate round by round (`--repeats`), so a loaded machine slows them alike; printed:
median and p99 over the decode layers of all rounds. `--base <commit>` adds that commit's Horizon
(`horizon@base`, its `horizon.py` loaded beside this tree's other modules) to the rotation and checks that every plan
of both is the same: a before / after of Horizon's own code under one load. `--base-tree DIR` (another checkout, e.g.
`git worktree add --detach DIR <commit>`) runs every system in both trees instead, each in a worker process of its own
(`plan_worker.py`: the tree's own modules, PreSched, the cache, the cost model and the predictors included), the
requests alternated between the two workers round by round, and checks that every plan of each system is the same
in both (`<system>@base` in the table): a before / after of any planning code under one load. `--profile` prints,
per point and system, where a decode plan's time goes instead (cProfile, cumulative per stage: `STAGES`).

The budget: one decode MoE layer of the model with every expert in GPU memory, from the cost model of `--machine`
(attention at the prompt's context, the shared experts, the routed experts active at that batch in one device call;
the routed experts' tokens from the same synthetic routing), at batch 1 and 64. A plan that takes longer than that
layer costs more than the layer itself would on a GPU that held the model; an offloaded layer (transfers, CPU
experts) is longer, so the plan is paid for only where it saves more than it costs.

The charged study (`--study`): each policy's own planning time charged on the simulated host per MoE layer
(`simulate.planning`, `engine.sim.pipeline.PlanningCharge`: mode `measured_cpu`, each plan call's thread CPU time, so
the host's other jobs do not inflate it; `--charge measured` for wall time), against the same run uncharged, at
Figure-11 sweep points (transition-table forecasts, `--seeds`), on the profile as fitted and on its roofline variant
(every per-call overhead 0: `gpu.kernel_overhead_us`, `gpu.call_overhead_us`, `cpu.expert_overhead_us`,
`cpu.dispatch_us`; `layer_overhead_us` and `pass_overhead_us` are 0 on the GPU profiles already). A charged run is not
exactly repeatable: each Horizon variant runs `--charged-repeats` times charged (the others once). Printed per point
and seed: Horizon against the best other policy, uncharged and charged, and Horizon's charged plan time; then Horizon
(its search priced by the charge) against its search always on (`horizon_search`) and never (`horizon_no_search`),
charged, mean ± std over the repeats, and whether it is at least the better of the two within one std:

    python engine/bench/bench_planning.py --study [--study-models mixtral_8x7b,qwen3_30b_a3b,deepseek_v2_lite]
        [--study-batches 1,4,16,64] [--seeds 0,1] [--charged-repeats 2] [--workers 2] [--json /tmp/plan/study.json]
        [--study-systems horizon,horizon_search,horizon_no_search,presched,hybrimoe,klotski,dali,layerwise]
        [--ours horizon_budget --merge <an earlier --json>]
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import subprocess
import sys
import time
import types
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from engine.bench.bench_horizon_study import Point, point_spec  # noqa: E402
from engine.bench.bench_simulate_sweep import scheduler_settings  # noqa: E402
from engine.sim.pipeline import PlanningCharge  # noqa: E402
from engine.sim.run import PreparedRouting, RunSpec, build_sim, prepare_routing, simulate  # noqa: E402
from schedulers.base import LayerPlan, LayerState, Phase  # noqa: E402
from schedulers.cost import CostModel  # noqa: E402
from schedulers.hardware import HardwareProfile  # noqa: E402


def timed_run(spec: RunSpec, routing: PreparedRouting, policy: Optional[type] = None
              ) -> tuple[list[float], list[LayerPlan]]:
    """(seconds of every decode `plan` call, every plan in order) of one simulated run (`policy`: the scheduler's class
    swapped for this one, `horizon_at`)."""
    sim, _, _ = build_sim(spec, routing)
    if policy is not None:
        sim.scheduler.__class__ = policy
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


# where a decode plan's time goes (`--profile`): (label, file, function) of the stages, cumulative (a stage includes
# what it calls: the forecasts are inside E_next, E_next inside eq. 3's queues)
STAGES = (("the whole plan", "presched.py", "plan"),
          ("PreSched: eq. 3 queues (E_next, forecasts inside)", "presched.py", "queue"),
          ("PreSched: E_next of a target (its forecast inside)", "presched.py", "candidates"),
          ("forecasts (predictor, top-k, loads)", "forecasts.py", "__getitem__"),
          ("PreSched: resident experts to the CPU", "presched.py", "resident_to_cpu"),
          ("PreSched: Q4 prefetches (deferred by Horizon)", "presched.py", "_decode_prefetch"),
          ("Horizon: search and slots (`finish`)", "horizon.py", "finish"),
          ("Horizon: candidate splits", "horizon.py", "candidate_splits"),
          ("Horizon: layer l+1 from its forecast", "horizon.py", "next_layer"),
          ("Horizon: two-layer search", "horizon.py", "search"),
          ("Horizon: next layer's times per split and count", "horizon.py", "next_layer_times"),
          ("cache: slots, evictions, admitted loads", "horizon.py", "plan_with_slots"),
          ("cache: victims (evictable, eviction order)", "policy.py", "victims"),
          ("per-expert times of the layer", "policy.py", "expert_times"))


def stage_profile(model: str, batch: int, machine: str, system: str, gen_len: int) -> list[str]:
    """`--profile`: cProfile around every decode `plan` call of one simulated run; per stage (`STAGES`) its
    cumulative time per plan and share of the plan, and the Python function calls per plan. The profiler inflates
    every call alike (~2x here), so read the shares, not the µs."""
    import cProfile
    import pstats

    spec = point_run_spec(model, batch, machine, system, gen_len)
    routing = prepare_routing(spec)
    sim, _, _ = build_sim(spec, routing)
    plan = sim.scheduler.plan
    profile = cProfile.Profile()
    plans = 0

    def profiled(state: LayerState) -> LayerPlan:
        nonlocal plans
        if state.phase is not Phase.decode:
            return plan(state)
        plans += 1
        profile.enable()
        try:
            return plan(state)
        finally:
            profile.disable()

    sim.scheduler.plan = profiled  # type: ignore[method-assign]
    sim.run(routing.passes)
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    calls = sum(nc for _, nc, _, _, _ in stats.values())
    cumulative: dict[tuple[str, str], float] = {}
    for (path, _, name), (_, _, _, cum, _) in stats.items():
        key = (Path(path).name, name)
        cumulative[key] = cumulative.get(key, 0.0) + cum
    whole = cumulative.get(("presched.py", "plan"), 0.0)
    lines = [f"{model} b{batch} {system}: {plans} decode plans, {calls / max(plans, 1):.0f} Python function calls a plan "
             "(under cProfile)", "| stage | µs per plan (profiled) | share of the plan |", "|---|---|---|"]
    for label, file, name in STAGES:
        seconds = cumulative.get((file, name))
        if seconds is not None:
            lines.append(f"| {label} | {seconds / plans * 1e6:,.0f} | {seconds / whole:.0%} |")
    return lines


def horizon_at(commit: str) -> type:
    """Horizon as `schedulers/offload/horizon.py` of git `commit` has it (beside this tree's PreSched and the rest),
    for a before / after of Horizon's own code alternated in one process (`--base`)."""
    import schedulers.base as base

    source = subprocess.run(["git", "show", f"{commit}:schedulers/offload/horizon.py"], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[2]).stdout
    name = f"horizon_at_{commit}"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    register = base.register
    base.register = lambda *a, **k: (lambda cls: cls)  # noqa: E731  (the registry keeps this tree's Horizon)
    try:
        exec(compile(source, f"{commit}:schedulers/offload/horizon.py", "exec"), module.__dict__)
    finally:
        base.register = register
    old = module.Horizon
    if "ahead" in inspect.signature(old.finish).parameters:
        return old

    class Before(old):  # a commit before `finish` took PreSched's Lookahead
        def finish(self, state, cpu, gpu, loads, prefetch, keep_working_set, ahead=None):  # type: ignore[override]
            return old.finish(self, state, cpu, gpu, loads, prefetch, keep_working_set)

    return Before


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


def roofline(hw: HardwareProfile) -> HardwareProfile:
    """`hw` with every per-call overhead 0 (the GPU's kernel and call dispatch, the CPU's per-expert call and
    per-layer hand-over, the executor's per-layer and per-pass host time): a GPU engine and a CPU kernel that cost
    only their FLOPs and bytes."""
    gpu = replace(hw.gpu, kernel_overhead_us=0.0, call_overhead_us=0.0, layer_overhead_us=0.0, pass_overhead_us=0.0)
    return replace(hw, gpu=gpu, cpu=replace(hw.cpu, expert_overhead_us=0.0, dispatch_us=0.0))


def charged_group(job: tuple[str, int, str, bool, tuple[str, ...], str, int, int]) -> list[dict[str, Any]]:
    """Every system at one (model, batch, machine, profile, seed) point, uncharged and with its planning charged (a
    charged run is not exactly repeatable: the Horizon variants `repeats` charged runs each, the others one), the
    systems alternated run by run."""
    model, batch, machine, at_roofline, systems, mode, seed, repeats = job
    rows = []
    routings: dict[int, PreparedRouting] = {}
    specs = {}
    for system in systems:
        spec = point_run_spec(model, batch, machine, system, gen_len=64, seed=seed)
        specs[system] = replace(spec, hardware=roofline(spec.hardware)) if at_roofline else spec
    runs = [(s, PlanningCharge()) for s in systems] + [(s, PlanningCharge(mode)) for r in range(repeats)
                                                      for s in (systems if r % 2 == 0 else systems[::-1])
                                                      if r == 0 or s.startswith("horizon")]
    for system, charge in runs:
        spec = specs[system]
        routing = routings.setdefault(spec.sequences, prepare_routing(spec))
        t0 = time.process_time()
        out = simulate(replace(spec, planning=charge), routing)
        rows.append({"model": model, "batch": batch, "machine": machine, "roofline": at_roofline, "system": system,
                     "seed": seed, "charge": charge.mode, "throughput_tok_s": out.summary["throughput_tok_s"],
                     "plan_median_us": out.summary.get("planning_charged_median_us_decode"),
                     "plan_p99_us": out.summary.get("planning_charged_p99_us_decode"),
                     "sim_cpu_s": time.process_time() - t0})
    return rows


def point_key(r: dict[str, Any]) -> tuple[str, int, str, bool]:
    return r["model"], r["batch"], r["machine"], r["roofline"]


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std (0 for one value)."""
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def search_table(rows: list[dict[str, Any]], mode: str, ours: str = "horizon", on: str = "horizon_search",
                 off: str = "horizon_no_search") -> list[str]:
    """Per point and seed: `ours` (Horizon pricing its search by the run's charge) against the search always on (`on`)
    and never (`off`), charged, mean ± std over the charged repeats; the last column: `ours` against the better of the
    two, and whether it is at least that within one std (the larger of the two stds); the uncharged `ours` against `on`
    (the same plans where planning is free)."""
    lines = [f"| point | profile | seed | {ours} charged | search on | search off | {ours} / better | "
             f"at least the better (1 std) | uncharged {ours} = search on |",
             "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({point_key(r) + (r.get("seed", 0),) for r in rows if r["system"] == ours},
                  key=lambda k: (k[0], k[3], k[1], k[4]))
    held = 0
    for model, batch, machine, at_roofline, seed in keys:
        def of(system: str, charge: str) -> list[float]:
            return [r["throughput_tok_s"] for r in rows if r["system"] == system and r["charge"] == charge
                    and point_key(r) == (model, batch, machine, at_roofline) and r.get("seed", 0) == seed]
        if not (of(on, mode) and of(off, mode)):
            continue
        (m, sd), (m_on, sd_on), (m_off, sd_off) = (mean_std(of(s, mode)) for s in (ours, on, off))
        better, sd_better = (m_on, sd_on) if m_on >= m_off else (m_off, sd_off)
        ok = m >= better - max(sd, sd_better)
        held += ok
        same = of(ours, "off") == of(on, "off")
        lines.append(f"| {model} {machine} b{batch} | {'roofline' if at_roofline else 'as fitted'} | {seed} | "
                     f"{m:.2f} ± {sd:.2f} | {m_on:.2f} ± {sd_on:.2f} | {m_off:.2f} ± {sd_off:.2f} | "
                     f"{m / better - 1:+.1%} | {'yes' if ok else '**no**'} | {'yes' if same else '**no**'} |")
    lines.append(f"{ours} at least the better of search on / off (within one std) at {held} of {len(lines) - 2} "
                 "points")
    return lines


def charged_table(rows: list[dict[str, Any]], mode: str, ours: str = "horizon") -> list[str]:
    """Per point: `ours` (a Horizon variant) and the best other policy (no Horizon variant), uncharged and charged
    (tok/s), the lead each way."""
    lines = [f"| point | profile | {ours} | best other | lead | {ours} charged | best other charged | lead charged | "
             f"{ours} plan median µs (charged) | best other's |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({point_key(r) + (r.get("seed", 0),) for r in rows if r["system"] == ours},
                  key=lambda k: (k[0], k[3], k[1], k[4]))
    for model, batch, machine, at_roofline, seed in keys:
        at = [r for r in rows if point_key(r) == (model, batch, machine, at_roofline) and r.get("seed", 0) == seed]
        cells = []
        for charge in ("off", mode):
            mine = averaged([r for r in at if r["system"] == ours and r["charge"] == charge])
            others = [averaged([r for r in at if r["system"] == system and r["charge"] == charge])
                      for system in sorted({r["system"] for r in at if not r["system"].startswith("horizon")})]
            if not others:  # only Horizon variants ran: the other columns stay empty
                others = [{"system": "-", "throughput_tok_s": math.nan, "plan_median_us": math.nan}]
            best = max(others, key=lambda r: r["throughput_tok_s"])
            cells.append((mine, best, mine["throughput_tok_s"] / best["throughput_tok_s"] - 1))
        (h0, b0, l0), (h1, b1, l1) = cells
        lines.append(f"| {model} {machine} b{batch} s{seed} | {'roofline' if at_roofline else 'as fitted'} | "
                     f"{h0['throughput_tok_s']:.2f} | {b0['throughput_tok_s']:.2f} ({b0['system']}) | {l0:+.1%} | "
                     f"{h1['throughput_tok_s']:.2f} | {b1['throughput_tok_s']:.2f} ({b1['system']}) | "
                     f"{'**' if l1 < 0 else ''}{l1:+.1%}{'**' if l1 < 0 else ''} | {h1['plan_median_us']:.0f} | "
                     f"{b1['plan_median_us']:.0f} |")
    return lines


def averaged(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's runs at one point and charge (the charged repeats) as one row: the mean throughput and plan time."""
    return {"system": rows[0]["system"], "throughput_tok_s": float(np.mean([r["throughput_tok_s"] for r in rows])),
            "plan_median_us": float(np.mean([r["plan_median_us"] or 0.0 for r in rows]))}


def charged_study(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The charged study's groups, `--workers` at a time; prints the table and the wall time."""
    systems = tuple(args.study_systems.split(","))
    jobs = [(m, int(b), args.machine, at_roofline, systems, args.charge, int(seed), args.charged_repeats)
            for seed in args.seeds.split(",") for b in args.study_batches.split(",")
            for m in args.study_models.split(",") for at_roofline in (False, True)]
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for group in pool.map(charged_group, jobs):  # in job order
            rows += group
            print(f"done: {group[0]['model']} b{group[0]['batch']} roofline={group[0]['roofline']} "
                  f"seed {group[0]['seed']}", flush=True)
            if args.json:  # as it goes: a long study interrupted keeps what it ran
                Path(args.json).write_text(json.dumps(rows, indent=1))
    shown = rows + (json.loads(Path(args.merge).read_text()) if args.merge else [])
    print("\n".join(charged_table(shown, args.charge, args.ours)))
    if {"horizon_search", "horizon_no_search"} <= {r["system"] for r in shown}:
        print("\n".join(search_table(shown, args.charge, args.ours)))
    print(f"{len(rows)} runs, wall {time.perf_counter() - t0:.0f} s with {args.workers} workers, "
          f"simulated CPU {sum(r['sim_cpu_s'] for r in rows):.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="mixtral_8x7b:64,qwen3_30b_a3b:8")
    ap.add_argument("--systems", default="presched,horizon")
    ap.add_argument("--machine", default="a100_pcie4")
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--base", default=None,
                    help="a git commit: its Horizon (`horizon@base`) alternated with this tree's, plans compared")
    ap.add_argument("--base-tree", default=None,
                    help="another checkout: every system timed there too (`<system>@base`), plans compared")
    ap.add_argument("--study", action="store_true", help="the charged-planning study instead (see the docstring)")
    ap.add_argument("--study-models", default="mixtral_8x7b,qwen3_30b_a3b,deepseek_v2_lite")
    ap.add_argument("--study-batches", default="1,4,16,64")
    ap.add_argument("--study-systems",
                    default="horizon,horizon_search,horizon_no_search,presched,hybrimoe,klotski,dali,layerwise")
    ap.add_argument("--seeds", default="0", help="the routing seeds of the study (comma-separated)")
    ap.add_argument("--charged-repeats", type=int, default=2, help="charged runs per Horizon variant, point and seed (the others: one)")
    ap.add_argument("--charge", default="measured_cpu", help="planning.mode of the charged runs")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the study's rows here")
    ap.add_argument("--ours", default="horizon", help="the Horizon variant the table compares (others: no Horizon)")
    ap.add_argument("--merge", default=None, help="an earlier study's --json rows, shown in the table too")
    ap.add_argument("--profile", action="store_true",
                    help="where each system's decode plan spends its time, per stage (cProfile), at every point")
    args = ap.parse_args(argv)
    if args.profile:
        for p in args.points.split(","):
            for system in args.systems.split(","):
                print("\n".join(stage_profile(p.split(":")[0], int(p.split(":")[1]), args.machine, system,
                                               args.gen_len)))
        return {}
    if args.study:
        return {"rows": charged_study(args)}
    points = [(p.split(":")[0], int(p.split(":")[1])) for p in args.points.split(",")]
    if args.base_tree:
        out = tree_rounds(points, args)
        return out | budget(points, args.machine)
    systems = args.systems.split(",") + (["horizon@base"] if args.base else [])
    policies = {"horizon@base": horizon_at(args.base)} if args.base else {}
    out: dict[str, Any] = {}
    for model, batch in points:
        specs = {s: point_run_spec(model, batch, args.machine, s.split("@")[0], args.gen_len) for s in systems}
        routings: dict[int, PreparedRouting] = {}
        seconds: dict[str, list[float]] = {s: [] for s in systems}
        plans: dict[str, list[str]] = {}
        for r in range(args.repeats):
            for s in systems if r % 2 == 0 else systems[::-1]:  # alternated: neither side always runs first
                spec = specs[s]
                routing = routings.setdefault(spec.sequences, prepare_routing(spec))
                took, made = timed_run(spec, routing, policies.get(s))
                seconds[s] += took
                plans.setdefault(s, [repr(p) for p in made])
        if args.base:
            same = plans["horizon@base"] == plans["horizon"]
            out[f"{model} b{batch} plans identical"] = same
            print(f"{model} b{batch}: every plan of horizon and horizon@{args.base} identical: {same} "
                  f"({len(plans['horizon'])} plans)")
        for s in systems:
            us = np.asarray(seconds[s]) * 1e6
            out[f"{model} b{batch} {s}"] = (float(np.median(us)), float(np.percentile(us, 99)), us.size)
            print(f"{model} b{batch} {args.machine} {s:>9}: plan per decode layer median {np.median(us):8.0f} us, "
                  f"p99 {np.percentile(us, 99):8.0f} us ({us.size} layers)")
    return out | budget(points, args.machine)


def budget(points: list[tuple[str, int]], machine: str) -> dict[str, Any]:
    """Prints and returns the in-memory decode MoE layer of each model at batch 1 and 64 (as fitted, roofline)."""
    out: dict[str, Any] = {}
    for model in dict(points):
        for batch in (1, 64):
            t, r = gpu_layer_s(model, batch, machine), gpu_layer_s(model, batch, machine, roofline=True)
            out[f"{model} gpu layer b{batch}"] = (t, r)
            print(f"budget: {model} {machine} in-memory decode MoE layer at batch {batch}: {t * 1e6:8.0f} us as "
                  f"the profile has it (per-call overheads fitted to the paper's PyTorch), {r * 1e6:6.0f} us at the "
                  "roofline")
    return out


class TreeWorker:
    """`plan_worker.py` serving from `tree` (its modules imported there), one request at a time."""

    def __init__(self, tree: Path):
        worker = Path(__file__).resolve().with_name("plan_worker.py")
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, str(worker)], cwd=tree, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def run(self, model: str, batch: int, machine: str, system: str, gen_len: int, plans: bool
            ) -> tuple[list[float], list[str]]:
        """(seconds of every decode plan call, repr of every plan when `plans`) of one simulated run."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        req = {"model": model, "batch": batch, "machine": machine, "system": system, "gen_len": gen_len,
               "plans": plans}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.tree}: the planning worker stopped (exit {self.proc.wait()}) on {req}")
        answer = json.loads(line)
        return answer["seconds"], answer["plans"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def tree_rounds(points: list[tuple[str, int]], args: argparse.Namespace) -> dict[str, Any]:
    """`--base-tree`: every system in this tree and in the other, each tree in a worker of its own, the two
    alternated run by run (each round flips which goes first); every plan compared per system and point."""
    workers = {"": TreeWorker(Path(__file__).resolve().parents[2]), "@base": TreeWorker(Path(args.base_tree).resolve())}
    out: dict[str, Any] = {}
    try:
        for model, batch in points:
            seconds: dict[str, list[float]] = {}
            plans: dict[str, list[str]] = {}
            for r in range(args.repeats):
                for system in args.systems.split(","):
                    for tag in (("", "@base") if r % 2 == 0 else ("@base", "")):
                        took, made = workers[tag].run(model, batch, args.machine, system, args.gen_len, r == 0)
                        seconds.setdefault(system + tag, []).extend(took)
                        if r == 0:
                            plans[system + tag] = made
            for system in args.systems.split(","):
                same = plans[system] == plans[system + "@base"]
                out[f"{model} b{batch} {system} plans identical"] = same
                print(f"{model} b{batch}: every plan of {system} in both trees identical: {same} "
                      f"({len(plans[system])} plans)")
            for name, took in seconds.items():
                us = np.asarray(took) * 1e6
                out[f"{model} b{batch} {name}"] = (float(np.median(us)), float(np.percentile(us, 99)), us.size)
                print(f"{model} b{batch} {args.machine} {name:>15}: plan per decode layer median {np.median(us):8.0f} "
                      f"us, p99 {np.percentile(us, 99):8.0f} us ({us.size} layers)", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    print("\n".join(tree_table(out, points, args.systems.split(","))))
    return out


def tree_table(out: dict[str, Any], points: list[tuple[str, int]], systems: list[str]) -> list[str]:
    """Markdown: per point and system, median / p99 µs per decode layer in the other tree and this one, the ratio of
    the medians, and whether every plan is the same."""
    lines = ["| point | system | base median / p99 µs | this median / p99 µs | this / base (median) | plans identical |",
             "|---|---|---|---|---|---|"]
    for model, batch in points:
        for system in systems:
            (bm, bp, _), (tm, tp, _) = out[f"{model} b{batch} {system}@base"], out[f"{model} b{batch} {system}"]
            lines.append(f"| {model} b{batch} | {system} | {bm:,.0f} / {bp:,.0f} | {tm:,.0f} / {tp:,.0f} | "
                         f"{tm / bm:.2f} | {out[f'{model} b{batch} {system} plans identical']} |")
    return lines


if __name__ == "__main__":
    main()
