"""Benchmark of the real offload executor (issue 6 §4). Prints figures; asserts nothing.

    python engine/bench/bench_offload.py                       # shipped mixtral-tiny, batch 8, 32 new tokens
    python engine/bench/bench_offload.py --model bench_mixtral_29m --batch 16 --predictor gate

1. Machinery cost: decode tokens/s of the offload executor with every expert resident against the
   plain in-memory model (one jitted decode loop) on the same batch, and the host time per MoE
   layer spent planning (LayerState + scheduler + validation) — the executor's fixed overhead.
2. A quarter of the experts in the cache: decode tokens/s and throughput (prefill included) of
   PreSched + the chosen predictor against HybriMoE, Fiddler and on-demand loading, in one run
   (best of `--repeats` alternated runs each: single runs on this shared 2-core machine vary by 30%),
   and PreSched's ratio to each system within every repeat (median, min-max).
3. Simulator agreement: the discrete-event simulator replays the same routing with the cost model
   of this machine (`--hardware`, default local_cpu, or `--calibrate` to measure it first) and the
   executor's measured predictor hit rate; predicted vs measured decode latency per step, and the
   profile's costs next to those each run's Timer ended with.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from conf import compose
from schedulers.hardware import load_hardware  # noqa: E402
from engine.offload.executor import OffloadExecutor, OffloadSettings  # noqa: E402
from engine.offload.store import ExpertStore  # noqa: E402
from engine.run import reference_trace, serve, warm_up  # noqa: E402
from predictors.factory import make_predictors  # noqa: E402
from engine.workloads import build_workload  # noqa: E402
from models.generation import Generator  # noqa: E402
from models.loading import load_model, load_tokenizer  # noqa: E402
from schedulers.base import SchedulerSettings, SchedulerSetup, build_scheduler, scheduler_settings  # noqa: E402
from schedulers.cost import CostModel  # noqa: E402


def batches_for(model_name: str, batch: int, prompt_len: int, new: int, n: int, seed: int):
    node = compose("run", [f"model={model_name}", f"workload.batch_size={batch}", f"workload.prompt_len={prompt_len}",
                           f"workload.gen_len={new}", f"workload.num_batches={n}", f"workload.seed={seed}"])
    cfg, model, folder = load_model(node.model)
    tok = load_tokenizer(folder)
    if tok is None:  # random-weight configs: random token prompts of prompt_len
        rng = np.random.default_rng(seed)

        class _B:
            def __init__(self, toks):
                self.tokens, self.gen_len, self.batch_size = toks, new, batch

            def token_lists(self):
                return [list(t) for t in self.tokens]

        return node, cfg, model, [_B(rng.integers(3, cfg.vocab_size, (batch, prompt_len)).tolist()) for _ in range(n)]
    sampler = build_workload(node.workload, tok, separator_id=cfg.eos_token_id)
    return node, cfg, model, list(sampler.batches(n))


def configured_scheduler(kind: str, **changes) -> SchedulerSettings:
    """`conf/scheduler/<kind>.yaml` as engine.run composes it, with `changes` applied."""
    return replace(scheduler_settings(compose("run", [f"scheduler={kind}"]).scheduler), **changes)


def executor_run(cfg, model, store, kind: str, slots: int, cost: CostModel, predictors, lookup, batches,
                 profile, label: str = "", validate: bool = False, fuse_resident: bool = True):
    L, E = len(cfg.moe_layers), cfg.num_experts
    settings = configured_scheduler(kind, use_predictor=bool(predictors), **({"label": label} if label else {}))
    sched = build_scheduler(settings, SchedulerSetup(L, E, cfg.num_experts_per_tok, slots, cost, profile))
    plan_time = [0.0, 0]
    inner = sched.plan

    def timed_plan(state):
        t = time.perf_counter()
        out = inner(state)
        plan_time[0] += time.perf_counter() - t
        plan_time[1] += 1
        return out

    sched.plan = timed_plan  # type: ignore[method-assign]
    with OffloadExecutor(model, store, sched, cost, OffloadSettings(cache_slots=slots, validate_plans=validate,
                                                                       fuse_resident=fuse_resident),
                         predictors, lookup) as ex:
        warm_up(ex, batches[1:], cfg, seq_offset=batches[0].batch_size)  # compiles every shape measured below
        outs, wall = serve(ex, batches[1:], cfg, seq_offset=batches[0].batch_size)
        hit = ex.book.measured_hit_rates().get(1)
    steps = [s for o in outs for s in o.step_s]
    decode_tok = sum(int(np.maximum(o.lengths - 1, 0).sum()) for o in outs)
    gen = sum(int(o.lengths.sum()) for o in outs)
    return {"decode_tok_s": decode_tok / sum(o.decode_s for o in outs), "throughput_tok_s": gen / wall,
            "decode_ms_per_step": 1e3 * float(np.mean(steps)), "plan_us_per_layer": 1e6 * plan_time[0] / max(plan_time[1], 1),
            "hit_rate": hit, "outs": outs, "cost": cost,
            "moved_mib_per_pass": sum(o.metrics.bytes_moved for o in outs) / 2**20 / max(len(steps) + len(outs), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mixtral_tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batches", type=int, default=2, help="measured batches (after one profiling batch)")
    ap.add_argument("--budget", type=float, default=0.25, help="fraction of the routed experts in the cache")
    ap.add_argument("--predictor", default="gate", help="conf/predictor entry for PreSched (llapor needs a checkpoint)")
    ap.add_argument("--predictor-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override in the predictor config, e.g. predictor.checkpoint=runs/.../predictors/llapor")
    ap.add_argument("--hardware", default="local_cpu", help="conf/hardware profile of the cost model and simulator")
    ap.add_argument("--calibrate", action="store_true", help="measure this machine first (engine.calibrate) and use "
                    "that profile instead of --hardware: the shipped one is from another day's load")
    ap.add_argument("--repeats", type=int, default=3, help="[2]: runs per scheduler, alternated; the best is reported")
    ap.add_argument("--schedulers", default="presched,hybrimoe,fiddler,ondemand")
    ap.add_argument("--sections", default="1,2,3", help="1: all resident vs in-memory; 2: the budget; 3: simulator "
                    "agreement (needs 2)")
    args = ap.parse_args()
    sections = set(args.sections.split(","))

    node, cfg, model, batches = batches_for(args.model, args.batch, args.prompt, args.new, args.batches + 1, seed=1)
    store = ExpertStore.from_model(model)
    hw = load_hardware(args.hardware)
    if args.calibrate:
        from engine.calibrate import calibrate

        hw, _ = calibrate(cfg, model, store, "calibrated", str(node.model.name))
    L, E = len(cfg.moe_layers), cfg.num_experts
    trace, rows = reference_trace(model, cfg, batches, args.model)
    lookup = lambda s, p: np.array([rows[(int(a), int(b))] for a, b in zip(s, p)])  # noqa: E731
    profile = trace.expert_loads(np.flatnonzero(trace.seq < batches[0].batch_size))
    print(f"model {args.model}: {L} MoE layers x {E} experts, expert {store.expert_bytes / 2**20:.2f} MiB, "
          f"batch {args.batch}, prompt <= {args.prompt}, +{args.new} tokens, hardware profile {hw.name}")

    model_name = str(node.model.name)
    bpp = store.dtype.itemsize

    def cost_model() -> CostModel:
        return CostModel(cfg, hw, model_name, bytes_per_param=bpp)

    if "1" in sections:
        section_resident(args, cfg, model, store, batches, lookup, cost_model)
    if "2" not in sections:
        return
    results = section_budget(args, cfg, model, store, batches, lookup, profile, trace, cost_model)
    if "3" in sections:
        section_sim(args, cfg, model_name, hw, store, trace, results, int(max(round(args.budget * L * E) - 2, 0)))


def section_resident(args, cfg, model, store, batches, lookup, cost_model) -> None:
    """[1] machinery cost, every expert resident: fused passes (the default) and layer by layer."""
    L, E = len(cfg.moe_layers), cfg.num_experts
    gen = Generator(model)
    gen.generate(batches[1].token_lists(), args.new)
    fused, layerwise, ref = [], [], []
    ref_tok_s: dict[bool, list[float]] = {True: [], False: []}  # the in-memory run just before each executor run
    for _ in range(max(args.repeats, 1)):  # alternated, best of each (single runs here vary by 30%)
        for runs, fuse in ((fused, True), (layerwise, False)):
            ref = [gen.generate(b.token_lists(), b.gen_len) for b in batches[1:]]
            ref_tok_s[fuse].append(sum(int(np.maximum(o.lengths - 1, 0).sum()) for o in ref) /
                                   sum(o.decode_s for o in ref))
            runs.append(executor_run(cfg, model, store, "ktransformers", L * E, cost_model(), {}, lookup,
                                     batches, np.ones((L, E), np.int64), "all resident", fuse_resident=fuse))
    best_ref = max(ref_tok_s[True] + ref_tok_s[False])
    for name, runs, refs in (("fused passes", fused, ref_tok_s[True]), ("layer by layer", layerwise, ref_tok_s[False])):
        best = max(runs, key=lambda r: r["decode_tok_s"])
        same = all(np.array_equal(a.tokens, b.tokens) for a, b in zip(best["outs"], ref))
        # each repeat's ratio is of runs next to each other: steadier than the ratio of bests under a changing load
        ratios = [r["decode_tok_s"] / t for r, t in zip(runs, refs)]
        print(f"\n[1] all {L * E} experts resident, {name}: in-memory {best_ref:.1f} decode tok/s, offload executor "
              f"{best['decode_tok_s']:.1f} tok/s (best of {len(runs)}) -> ratio {best['decode_tok_s'] / best_ref:.3f}; "
              f"per-repeat ratios median {np.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
              f"planning {best['plan_us_per_layer']:.0f} us per MoE layer; tokens equal: {same}")


def section_budget(args, cfg, model, store, batches, lookup, profile, trace, cost_model) -> dict:
    """[2] a budget of a fraction of the experts: every scheduler on the same batches."""
    L, E = len(cfg.moe_layers), cfg.num_experts
    slots = max(int(round(args.budget * L * E)) - 2, 0)
    node_pred = compose("run", [f"model={args.model}", f"predictor={args.predictor}", *args.predictor_set]).predictor
    print(f"\n[2] budget {args.budget:g} of the experts: {slots} cache slots + 2 staging buffers")
    names = args.schedulers.split(",")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(max(args.repeats, 1)):  # alternate the systems so a load change on the machine hits them alike
        for name in names:
            preds = make_predictors(node_pred, [1, 2, 3], model, trace) if name in (
                "presched", "hybrimoe", "fate", "klotski") else {}
            runs[name].append(executor_run(cfg, model, store, name, slots, cost_model(), preds, lookup, batches, profile))
    results = {}
    for name in names:
        r = results[name] = max(runs[name], key=lambda x: x["throughput_tok_s"])
        spread = [x["throughput_tok_s"] for x in runs[name]]
        print(f"  {name:14s} decode {r['decode_tok_s']:8.1f} tok/s  throughput {r['throughput_tok_s']:8.1f} tok/s "
              f"(best of {len(spread)}, worst {min(spread):.1f})  {r['decode_ms_per_step']:7.2f} ms/step  "
              f"predictor hit {r['hit_rate'] if r['hit_rate'] is not None else '-'}  "
              f"MiB moved per pass, each repeat: {[round(x['moved_mib_per_pass'], 2) for x in runs[name]]}")
    if "presched" in results:
        base = results["presched"]["throughput_tok_s"]
        print("  PreSched throughput ratios: " + ", ".join(f"vs {k} {base / v['throughput_tok_s']:.2f}x"
                                                        for k, v in results.items() if k != "presched"))
        # each repeat's runs are next to each other: their ratio is steadier than the ratio of bests
        for key in ("throughput_tok_s", "decode_tok_s"):
            paired = {k: [a[key] / b[key] for a, b in zip(runs["presched"], runs[k])] for k in names if k != "presched"}
            print(f"  PreSched {key} per-repeat ratios, median (min-max): " + ", ".join(
                f"vs {k} {np.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})" for k, r in paired.items()))
    return results


def with_timer_costs(hw, model_name: str, cost: CostModel):
    """`hw` whose `measured` entry for the model holds the costs the executor's Timer ended the run with."""
    import dataclasses

    from schedulers.hardware import ExpertTimes

    times = ExpertTimes(transfer_ms=cost.t_io * 1e3, gpu_ms=float(cost.t_g(1)) * 1e3, cpu_beta_ms=cost.beta_s * 1e3,
                        cpu_startup_ms=cost.cpu_startup_s * 1e3, call_overhead_ms=cost.call_overhead_s * 1e3,
                        layer_overhead_ms=cost.layer_overhead_s * 1e3, pass_overhead_ms=cost.pass_overhead_s * 1e3,
                        cpu_dispatch_ms=cost.cpu_dispatch_s * 1e3)
    return dataclasses.replace(hw, measured={**hw.measured, model_name: times})


def section_sim(args, cfg, model_name, hw, store, trace, results: dict, slots: int) -> None:
    """[3] the simulator replays the same routing with the profile's cost model (as calibrated) and with
    the costs the executor's Timer measured during that scheduler's run."""
    with tempfile.TemporaryDirectory() as tmp:
        path = trace.save(Path(tmp) / "trace.npz")
        print("\n[3] simulator vs executor, decode latency per step (same routing; profile = calibrated costs, "
              "timer = the executor's online costs):")
        print(f"  {'scheduler':14s} {'measured':>9s} {'sim/profile':>12s} {'error':>6s} {'sim/timer':>10s} {'error':>6s}")
        for name, r in results.items():
            row = [f"  {name:14s} {r['decode_ms_per_step']:9.2f}"]
            for profile_hw in (hw, with_timer_costs(hw, model_name, r["cost"])):
                predicted = simulated_decode_ms(args, cfg, model_name, profile_hw, store, path, name, r, slots)
                row.append(f"{predicted:12.2f} {100 * (predicted - r['decode_ms_per_step']) / r['decode_ms_per_step']:+5.0f}%")
            print(" ".join(row))
        print("  costs (ms): profile vs each run's Timer at its end")
        fields = ("transfer_ms", "gpu_ms", "cpu_beta_ms", "cpu_startup_ms", "call_overhead_ms", "layer_overhead_ms",
                  "pass_overhead_ms", "cpu_dispatch_ms")
        print(f"  {'source':>15s} " + " ".join(f"{f.removesuffix('_ms'):>15s}" for f in fields))
        costs = [("profile", CostModel(cfg, hw, model_name, bytes_per_param=store.dtype.itemsize))] + \
                [(name, r["cost"]) for name, r in results.items()]
        for name, cost in costs:
            times = with_timer_costs(hw, model_name, cost).measured[model_name]
            print(f"  {name:>15s} " + " ".join(f"{getattr(times, f):15.4f}" for f in fields))


def simulated_decode_ms(args, cfg, model_name: str, hw, store, path, name: str, r: dict, slots: int) -> float:
    """The simulator's decode latency per step (ms) of scheduler `name` on the recorded routing at `path`."""
    from engine.sim.run import RoutingConfig, RunSpec, simulate
    from predictors.config import oracle_config

    spec = RunSpec(model=cfg, model_name=model_name, hardware=hw,
                   scheduler=configured_scheduler(name, label=name),
                   routing=RoutingConfig(source="trace", name="reference", path=str(path)),
                   batch_size=args.batch, prompt_len=args.prompt, gen_len=args.new, profile_batches=1,
                   num_batches=args.batches, bytes_per_param=store.dtype.itemsize, cache_slots=slots,
                   predictor=oracle_config(hit_rate=r["hit_rate"] or 1.0))
    return 1e3 * simulate(spec).summary["decode_latency_s"]

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
