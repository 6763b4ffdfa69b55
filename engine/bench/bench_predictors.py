"""Benchmark of the expert predictors: forecast latency per layer for 64 tokens, one LLaPor online
fine-tuning step (128 buffered tokens), and parameter memory per layer.

    python -m engine.bench.bench_predictors --dir runs/predictors_train/<run>/predictors
    python -m engine.bench.bench_predictors --hidden 128 --experts 32 --top-k 4 --layers 7   # synthetic shapes

Targets (issue 5, LayerScope Table 4): forecast <= 0.5 ms per layer, one online step <= 5 ms.
Figures are printed (and optionally written as JSON); nothing is asserted. Latency is wall time of
`predict(ctx)` as a consumer calls it (numpy in, numpy out), median over `--reps` calls after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from conf import compose
from models.config import Family, ModelConfig
from predictors.base import LayerContext
from predictors.common import TrainedPredictor
from predictors.config import predictor_config
from predictors.data import split_rows
from predictors.gate import GatePredictor
from predictors.groups import groups_from_data
from predictors.llapor import fit_llapor
from predictors.stats import StatsPredictor
from predictors.synthetic import shift_rule_trace
from predictors.token import fit_token


def time_ms(fn: Callable[[], Any], reps: int, warmup: int = 3) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return {"median_ms": statistics.median(samples), "p90_ms": samples[int(0.9 * (len(samples) - 1))],
            "min_ms": samples[0]}


def context(pred: TrainedPredictor, hidden_size: int, tokens: int, rng: np.random.Generator, layer: int) -> LayerContext:
    experts = np.stack([rng.choice(pred.num_experts, pred.top_k, replace=False) for _ in range(tokens)])
    weights = rng.dirichlet(np.ones(pred.top_k), size=tokens).astype(np.float32)
    return LayerContext(layer=layer, step=0, experts=experts, weights=weights,
                        hidden=rng.standard_normal((tokens, hidden_size)).astype(np.float32),
                        tokens=rng.integers(0, 256, tokens))


def hidden_size_of(pred: TrainedPredictor, default: int) -> int:
    for arrays in pred.layer_arrays().values():
        if "mean" in arrays:
            return int(np.shape(arrays["mean"])[0])
        if "kernel" in arrays:
            return int(np.shape(arrays["kernel"])[0])
    return default


def bench_predictor(pred: TrainedPredictor, tokens: int, reps: int, hidden_default: int, seed: int = 0
                    ) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    H = hidden_size_of(pred, hidden_default)
    per_layer = {}
    for target in pred.targets:
        ctx = context(pred, H, tokens, rng, target - pred.distance)
        per_layer[target] = time_ms(lambda: pred.predict(ctx), reps)
    mem = pred.memory_mb()
    out = {"kind": pred.kind, "distance": pred.distance, "forecast_ms_median_max": max(r["median_ms"] for r in per_layer.values()),
           "forecast_ms_median_mean": float(np.mean([r["median_ms"] for r in per_layer.values()])),
           "forecast_ms": per_layer, "memory_mb": mem, "memory_mb_max": max(mem.values()), "memory_mb_min": min(mem.values())}
    shared = pred.shared_arrays()
    if shared is not None:
        from predictors.nets import param_bytes

        out["shared_memory_mb"] = param_bytes(shared) / 2**20
    fine_tune = getattr(pred, "fine_tune", None)
    if fine_tune is not None:
        out["online_step_ms"] = bench_online_step(pred, H, rng, reps)
    return out


def bench_online_step(pred: Any, hidden_size: int, rng: np.random.Generator, reps: int) -> dict[int, dict[str, float]]:
    """One AdamW step on a full 128-token buffer, per layer (online.steps forced to 1)."""
    pred.cfg.llapor.online.steps = 1
    out = {}
    for target in pred.targets:
        spec = pred.cfg.llapor.online
        mon = pred.monitor(target)
        n = spec.buffer
        ctx = context(pred, hidden_size, n, rng, target - pred.distance)
        from predictors.data import multi_hot, routing_vector

        mon.push(np.zeros(n), ctx.hidden, routing_vector(ctx.experts, ctx.weights, pred.num_experts),
                 multi_hot(ctx.experts, pred.num_experts))
        out[target] = time_ms(lambda: pred.fine_tune(target), reps)
    return out


def machine_conditions(load_before: tuple[float, ...], load_after: tuple[float, ...]) -> dict[str, Any]:
    """What the figures were measured under: CPUs, 1-minute load averages, JAX backend."""
    return {"cpus": os.cpu_count(), "load_before": load_before[0], "load_after": load_after[0],
            "jax": jax.__version__, "backend": jax.default_backend()}


def synthetic_predictors(hidden: int, experts: int, top_k: int, layers: int, epochs: int) -> list[TrainedPredictor]:
    """LLaPor, token, gate and MoEless at the given shapes, fitted briefly on a random trace (shapes, not accuracy)."""
    rng = np.random.default_rng(0)
    trace = shift_rule_trace(rng, num_layers=layers, num_experts=experts, top_k=top_k, hidden=hidden, n_seq=16,
                             rows_per_seq=64, signal=1.0, vocab=256)
    split = split_rows(trace, 0.25)
    groups = groups_from_data(trace, split.train)
    base = compose("predictors_train")
    llapor_cfg = predictor_config(base.predictor)
    llapor_cfg.train.epochs = epochs
    token_cfg = predictor_config(base.baselines.token)
    token_cfg.train.epochs = epochs
    llapor, _ = fit_llapor(trace, split.train, llapor_cfg, groups)
    token, _ = fit_token(trace, split.train, token_cfg, rng.standard_normal((256, hidden)))
    model_cfg = ModelConfig(family=Family.mixtral, vocab_size=256, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=4, intermediate_size=hidden,
                            num_experts=experts, num_experts_per_tok=top_k)
    kernels = {j: rng.standard_normal((hidden, experts)).astype(np.float32) for j in range(1, layers)}
    gate = GatePredictor("gate", 1, model_cfg, kernels, {j: np.zeros(experts, np.float32) for j in kernels})
    return [llapor, token, gate, StatsPredictor.fit(trace, split.train)]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, help="folder of predictor folders (predictors.train's `predictors/`)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=128, help="synthetic: hidden size")
    ap.add_argument("--experts", type=int, default=8, help="synthetic: experts per layer")
    ap.add_argument("--top-k", type=int, default=2, help="synthetic: experts per token")
    ap.add_argument("--layers", type=int, default=8, help="synthetic: MoE layers")
    ap.add_argument("--epochs", type=int, default=1, help="synthetic: training epochs (shapes only)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)

    if args.dir:
        from predictors.checkpoint import META_FILE, load_predictor_folder

        folders = sorted(p.parent for p in args.dir.glob(f"*/{META_FILE}"))
        if not folders:
            raise SystemExit(f"--dir {args.dir}: no predictor folders ({META_FILE}) inside")
        preds = [(f.name, load_predictor_folder(f)) for f in folders]
    else:
        preds = [(p.name, p) for p in synthetic_predictors(args.hidden, args.experts, args.top_k, args.layers,
                                                           args.epochs)]
    load_before = os.getloadavg()
    results = {name: bench_predictor(p, args.tokens, args.reps, args.hidden) for name, p in preds}
    conditions = machine_conditions(load_before, os.getloadavg())
    table = Table(title=f"predictor benchmark ({args.tokens} tokens per forecast, median of {args.reps})",
                  caption=f"{conditions['cpus']} CPUs, load average {conditions['load_before']:.2f} before, "
                          f"{conditions['load_after']:.2f} after (other processes inflate every figure)")
    for col in ("predictor", "forecast ms/layer (max median)", "online step ms (max median)", "MB/layer (min-max)"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        online = r.get("online_step_ms")
        table.add_row(name, f"{r['forecast_ms_median_max']:.3f}",
                      f"{max(v['median_ms'] for v in online.values()):.3f}" if online else "-",
                      f"{r['memory_mb_min']:.3f}-{r['memory_mb_max']:.3f}")
    Console().print(table)
    if args.json:
        from core.telemetry import atomic_write_text, to_jsonable

        atomic_write_text(args.json, json.dumps(to_jsonable({"conditions": conditions, "predictors": results}), indent=2))
    return results


if __name__ == "__main__":
    main()
