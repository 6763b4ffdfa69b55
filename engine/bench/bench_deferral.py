"""Expert Deferral (kTransformers, SOSP'25): what it costs in accuracy and what it buys in the simulator.

    python engine/bench/bench_deferral.py [--deferred 1] [--windows 8] [--length 128]
        [--points mixtral_8x7b:a100_pcie4:64,mixtral_8x7b:a100_pcie4:1,...] [--systems ...] [--skip-accuracy]

**Accuracy**, as the quantization table measures it (`models.quant.accuracy`: its held-out windows and its `compare`):
each shipped trained tiny model run teacher-forced over the validation windows with `--deferred` experts per token
deferred at every MoE layer but the last (`engine.offload.deferral.DeferringExperts`, every routed expert counted as a
CPU expert: kTransformers' usual placement and deferral's largest effect), against the same model without deferral:
perplexity, mean / p99 KL(exact || deferred) of the next-token distributions, greedy (argmax) agreement. Every
position of a window defers, the prompt's too; the executor defers in decode steps only, so a served sequence's
prompt is exact and this is the pessimistic side.

**Throughput**: the simulator at each `model:machine:batch` point (Figure-11 settings: prompt 512, 64 generated,
transition-table forecasts, seed 0), every system on the same routing, tok/s and decode latency per step.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

SYSTEMS = ("ktransformers", "ktransformers_deferral", "horizon", "presched", "klotski")
POINTS = "mixtral_8x7b:a100_pcie4:64,mixtral_8x7b:a100_pcie4:1,mixtral_8x7b:a100_pcie4:4,qwen3_30b_a3b:a100_pcie4:4"


def deferred_log_probs(model: Any, tokens: np.ndarray, per_token: int) -> np.ndarray:
    """float32 [W, S, V] log-softmax of the next-token logits, teacher-forced, with `per_token` experts deferred."""
    from engine.offload.deferral import DeferringExperts
    from models.quant.accuracy import log_probs

    return log_probs(model, tokens, executor=lambda: DeferringExperts(model.cfg, per_token))


def accuracy(models: Sequence[str], deferred: Sequence[int], windows: int, length: int) -> list[dict[str, Any]]:
    """One row per (model, experts deferred per token): `models.quant.accuracy.compare` against the exact model."""
    from models.loading import load_model
    from models.quant.accuracy import SHIPPED, compare, held_out_windows

    rows = []
    for name in models:
        ckpt = SHIPPED.get(name, name)
        tokens = held_out_windows(ckpt, windows, length)
        _, model, _ = load_model({"name": name, "checkpoint": ckpt}, dtype="auto")
        ref = deferred_log_probs(model, tokens, 0)
        for d in [0, *deferred]:
            start = time.perf_counter()
            lp = ref if d == 0 else deferred_log_probs(model, tokens, d)
            rows.append({"model": name, "deferred": d, "top_k": model.cfg.num_experts_per_tok,
                         **compare(ref, lp, tokens), "tokens": int(tokens.size), "seconds": time.perf_counter() - start})
    return rows


def accuracy_table(rows: list[dict[str, Any]]) -> str:
    out = ["| model | top-k | deferred per token | perplexity | mean KL | p99 KL | top-1 agreement |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {r['model']} | {r['top_k']} | {r['deferred']} | {r['ppl']:.3f} | {r['kl_mean']:.5f} | "
            f"{r['kl_p99']:.4f} | {100 * r['top1_agree']:.2f} % |" for r in rows]
    return "\n".join(out)


def throughput(points: Sequence[str], systems: Sequence[str], seed: int = 0) -> list[dict[str, Any]]:
    """Every system at every `model:machine:batch` point on one routing per in-flight width."""
    from engine.bench.bench_horizon_study import Point, point_spec
    from engine.bench.bench_simulate_sweep import scheduler_settings
    from engine.sim.run import prepare_routing, simulate

    rows = []
    for p in points:
        model, machine, batch = p.split(":")
        base = point_spec(Point("sweep", model, machine, int(batch)), seed)
        routings: dict[int, Any] = {}
        for system in systems:
            spec = replace(base, scheduler=scheduler_settings(system))
            try:
                out = simulate(spec, routings.setdefault(spec.sequences, prepare_routing(spec)))
            except ValueError as err:
                rows.append({"point": p, "system": system, "error": str(err)})
                continue
            routed = sum(int(fp.loads.sum()) for fp in routings[spec.sequences].passes if not fp.prefill)
            rows.append({"point": p, "system": system, "tok_s": out.summary["throughput_tok_s"],
                         "latency_s": out.summary["decode_latency_s"],
                         "pairs_hit": 1.0 - getattr(out.sim, "missed_pairs", 0) / max(routed, 1)})  # speculation's
            print(f"{p} {system}: {rows[-1]['tok_s']:.2f} tok/s, decode step {rows[-1]['latency_s']:.3f} s", flush=True)
    return rows


def throughput_table(rows: list[dict[str, Any]], systems: Sequence[str]) -> str:
    points = list(dict.fromkeys(r["point"] for r in rows))
    out = ["| point | " + " | ".join(systems) + " |", "|---" * (len(systems) + 1) + "|"]
    for p in points:
        cells = []
        for s in systems:
            r = next((r for r in rows if r["point"] == p and r["system"] == s), None)
            cells.append("—" if r is None or "error" in r else f"{r['tok_s']:.2f} ({1e3 * r['latency_s']:.0f} ms)")
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def study_arguments(ap: argparse.ArgumentParser, systems: Sequence[str]) -> None:
    """The arguments an accuracy-and-throughput study of an output-changing mechanism takes (this one, speculation's)."""
    ap.add_argument("--models", default="mixtral-tiny,deepseek-tiny")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--points", default=POINTS)
    ap.add_argument("--systems", default=",".join(systems))
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")


def run_study(args: argparse.Namespace, knob: list[int], accuracy_rows: Callable[..., list[dict]],
              accuracy_table: Callable[[list[dict]], str],
              after_throughput: Optional[Callable[[list[dict]], None]] = None) -> None:
    """Print the accuracy table (`accuracy_rows(models, knob, windows, length)`) and the simulator's throughput table."""
    start = time.perf_counter()
    if not args.skip_accuracy:
        rows = accuracy_rows(args.models.split(","), knob, args.windows, args.length)
        print(f"held-out text: {args.windows} windows of {args.length} tokens per model, teacher-forced")
        print(accuracy_table(rows), flush=True)
    if not args.skip_throughput:
        systems = args.systems.split(",")
        print("simulator, seed 0, tok/s (decode step)")
        rows = throughput(args.points.split(","), systems)
        print(throughput_table(rows, systems))
        if after_throughput is not None:
            after_throughput(rows)
    print(f"wall {time.perf_counter() - start:.0f} s")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deferred", default="1")
    study_arguments(ap, SYSTEMS)
    args = ap.parse_args(argv)
    run_study(args, [int(d) for d in args.deferred.split(",")], accuracy, accuracy_table)


if __name__ == "__main__":
    main()
