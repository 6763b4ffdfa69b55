"""Decision time of the MoEless Expert Scaler + Placer per layer, against a layer's forward time.

    python -m engine.bench.bench_scaler_placer                 # Mixtral-8x7B, Phi-3.5-MoE, Llama-4-Scout
    python -m engine.bench.bench_scaler_placer --json out.json

MoEless §6.6 and issue 7 §4: scaling and placement must cost well below one MoE layer's forward
time (they run asynchronously, overlapped with the d layers before the target). For each model
shape, forecast loads come from the synthetic router over prefill (a 1 s Azure-like batch) and
decode (8-64 sequences) steps; per forecast the timed call is `MoElessPolicy.plan` (Algorithm 1
then Algorithm 2, warm-starting from the replicas alive after the previous plan). The layer's
forward time is the MoEless §3.3 model of the same loads on 8x A6000 (`serve`'s defaults), and
the EPLB rebalance (all layers, done every ten minutes) is timed for scale. The layer's forward
time is given twice: the §3.3 linear model (alpha * tokens: tiny at decode, where it ignores the
weight streaming) and the roofline variant (kernel overhead + weight streaming + GEMMs). Figures
are printed (median and p99 wall time over repeats, and the mean CPU time of the process: on a shared
machine the wall time includes waiting for a core); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from conf import compose
from schedulers.hardware import load_hardware
from engine.serverless.latency_model import LatencyKind, LatencySettings, ServerlessCostModel
from schedulers.serverless.moeless import default_slots
from engine.serverless.slots import SlotMap
from engine.synthetic_routing import SyntheticRouter
from models.loading import resolve_model_config
from schedulers.serverless.eplb import rebalance_experts
from schedulers.serverless.moeless import MoElessPolicy
from schedulers.serverless.static_ep import static_placement

MODELS = ("mixtral_8x7b", "phi35_moe", "llama4_scout")


def forecasts(router: SyntheticRouter, rng: np.random.Generator, prefill_tokens: int, decode_seqs: list[int]
              ) -> dict[str, np.ndarray]:
    """Per phase: loads [steps, L, E] of synthetic routing (prefill: one batch of 4 prompts)."""
    E = router.E
    out = {}
    ex, _ = router.prefill(4, prefill_tokens // 4, rng)
    out["prefill"] = np.stack([np.bincount(ex[layer].reshape(-1), minlength=E) for layer in range(router.L)])[None]
    dec = []
    for n in decode_seqs:
        prev = router.prefill(n, 1, rng)[0]
        ex, _ = router.decode(prev, rng)
        dec.append(np.stack([np.bincount(ex[layer].reshape(-1), minlength=E) for layer in range(router.L)]))
    out["decode"] = np.stack(dec)
    return out


def bench_model(name: str, repeats: int, G: int = 8) -> list[dict[str, Any]]:
    cfg = resolve_model_config(compose("serve", [f"model={name}"]).model)
    hw = load_hardware("a6000")
    cost = ServerlessCostModel(cfg, hw, G)
    roofline = ServerlessCostModel(cfg, hw, G, LatencySettings(kind=LatencyKind.roofline))
    router = SyntheticRouter.for_model(cfg, model_seed=0)
    rng = np.random.default_rng(0)
    E, L = cfg.num_experts, len(cfg.moe_layers)
    slots = default_slots(E, G)
    rows = []
    for phase, loads in forecasts(router, rng, prefill_tokens=8192, decode_seqs=[8, 16, 32, 64]).items():
        policy = MoElessPolicy(E, G, slots, cost.expert_bytes)
        maps = [SlotMap(E, G, slots) for _ in range(L)]
        times, cpu, layer_s, layer_roof = [], [], [], []
        for _ in range(repeats):
            for step in loads:
                for layer in range(L):
                    live = maps[layer].live()
                    t0, c0 = time.perf_counter(), time.process_time()
                    placement = policy.plan(layer, step[layer], live)
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                    maps[layer].apply(placement)  # the mechanism's bookkeeping, not timed
                    layer_s.append(cost.moe_time(static_placement(E, G), step[layer]).moe_s)
                    layer_roof.append(roofline.moe_time(static_placement(E, G), step[layer]).moe_s)
        t = np.asarray(times)
        fwd, roof = float(np.median(layer_s)), float(np.median(layer_roof))
        rows.append({"model": name, "phase": phase, "experts": E, "devices": G, "slots": slots,
                     "decision_us_median": float(np.median(t) * 1e6), "decision_us_p99": float(np.quantile(t, 0.99) * 1e6),
                     "decision_cpu_us_mean": float(np.mean(cpu) * 1e6),
                     "layer_forward_us_median": fwd * 1e6, "layer_forward_roofline_us_median": roof * 1e6,
                     "decision_over_forward": float(np.median(t)) / fwd if fwd > 0 else float("nan"),
                     "decision_over_forward_roofline": float(np.median(t)) / roof if roof > 0 else float("nan")})
    hist = np.random.default_rng(1).integers(0, 10_000, size=(L, E)).astype(np.float64)
    t0 = time.perf_counter()
    for _ in range(max(repeats // 4, 1)):
        rebalance_experts(hist, E + G, 1, 1, G)
    rows.append({"model": name, "phase": "eplb_rebalance_all_layers", "experts": E, "devices": G, "slots": 2,
                 "decision_us_median": (time.perf_counter() - t0) / max(repeats // 4, 1) * 1e6,
                 "decision_us_p99": float("nan"), "decision_cpu_us_mean": float("nan"), "layer_forward_us_median": float("nan"),
                 "layer_forward_roofline_us_median": float("nan"), "decision_over_forward": float("nan"),
                 "decision_over_forward_roofline": float("nan")})
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    rows = [row for name in args.models for row in bench_model(name, args.repeats)]
    table = Table(title="MoEless scaler + placer decision time per layer (8 devices)")
    for col in ("model", "phase", "E", "decide med us", "p99 us", "cpu mean us", "fwd §3.3 us", "fwd roofline us",
                "decide/fwd §3.3", "decide/fwd roofline"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model"], r["phase"], str(r["experts"]), f"{r['decision_us_median']:.1f}",
                      f"{r['decision_us_p99']:.1f}", f"{r['decision_cpu_us_mean']:.1f}", f"{r['layer_forward_us_median']:.1f}",
                      f"{r['layer_forward_roofline_us_median']:.1f}", f"{r['decision_over_forward']:.3f}",
                      f"{r['decision_over_forward_roofline']:.3f}")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return rows


if __name__ == "__main__":
    main()
