"""Speculative expert execution (arXiv 2603.19289, 2026): what it costs in accuracy and what it buys in the simulator.

    python engine/bench/bench_speculation.py [--slots 0,4] [--windows 8] [--length 128]
        [--points mixtral_8x7b:a100_pcie4:64,...] [--systems ...] [--skip-accuracy] [--skip-throughput]

**Accuracy**, as the quantization table and Expert Deferral's measure it (`models.quant.accuracy`: its held-out
windows and its `compare`): each shipped trained tiny model run teacher-forced with the paper's per-token speculation
at every MoE layer but the first (`engine.offload.speculation.SpeculatingExperts`: layer l+1's router on layer l's
gate input names each token's `slots` experts of layer l+1, which are executed in place of its routed ones where they
differ; `--slots 0` means top-k, the paper's setting, where only the speculated experts are there), against the exact
model: perplexity, mean / p99 KL(exact || speculated), greedy agreement, and the share of (token, slot) pairs the
speculation hit. Every position speculates, the prompt's too (the policy speculates in decode only: the pessimistic side).

**Throughput**: the simulator at each `model:machine:batch` point (Figure-11 settings, transition-table forecasts,
seed 0), every system on the same routing (`engine.bench.bench_deferral.throughput`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from engine.bench.bench_deferral import run_study, study_arguments  # noqa: E402

SYSTEMS = ("fate", "speculative", "horizon", "presched", "klotski")


def speculated_log_probs(model: Any, tokens: np.ndarray, slots: int) -> tuple[np.ndarray, float]:
    """(float32 [W, S, V] teacher-forced next-token log-softmax with per-token speculation of `slots` experts,
    mean hit share of the speculated layers)."""
    from engine.offload.speculation import SpeculatingExperts
    from models.quant.accuracy import log_probs

    made: list[SpeculatingExperts] = []

    def executor() -> SpeculatingExperts:
        made.append(SpeculatingExperts(model, slots))
        return made[-1]

    lp = log_probs(model, tokens, executor=executor)
    hits = [h for e in made for h in e.hits]
    return lp, float(np.mean(hits)) if hits else 1.0


def accuracy(models: Sequence[str], slots: Sequence[int], windows: int, length: int) -> list[dict[str, Any]]:
    """One row per (model, speculated experts per token): `models.quant.accuracy.compare` against the exact model."""
    from models.loading import load_model
    from models.moe import DEFAULT_EXECUTOR
    from models.quant.accuracy import SHIPPED, compare, held_out_windows, log_probs

    rows = []
    for name in models:
        ckpt = SHIPPED.get(name, name)
        tokens = held_out_windows(ckpt, windows, length)
        _, model, _ = load_model({"name": name, "checkpoint": ckpt}, dtype="auto")
        ref = log_probs(model, tokens, executor=lambda: DEFAULT_EXECUTOR)  # eager as the speculating runs are
        k = model.cfg.num_experts_per_tok
        for s in dict.fromkeys(s or k for s in slots):
            start = time.perf_counter()
            lp, hit = speculated_log_probs(model, tokens, s)
            rows.append({"model": name, "top_k": k, "experts": model.cfg.num_experts, "slots": s, "hit": hit,
                         **compare(ref, lp, tokens), "seconds": time.perf_counter() - start})
            print(f"{name} slots {s}: hit {hit:.3f}, mean KL {rows[-1]['kl_mean']:.5f}", flush=True)
    return rows


def accuracy_table(rows: list[dict[str, Any]]) -> str:
    out = ["| model | top-k of E | speculated per token | pairs hit | perplexity | mean KL | p99 KL | top-1 agreement |",
           "|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['model']} | {r['top_k']} of {r['experts']} | {r['slots']} | {100 * r['hit']:.1f} % | {r['ppl']:.3f} | "
            f"{r['kl_mean']:.5f} | {r['kl_p99']:.4f} | {100 * r['top1_agree']:.2f} % |" for r in rows]
    return "\n".join(out)


def hit_lines(rows: list[dict]) -> None:
    """What the speed costs: the decode (token, slot) pairs computed by their routed expert."""
    for r in rows:
        if r["system"] == "speculative" and "error" not in r:
            print(f"{r['point']}: speculative execution computed {100 * r['pairs_hit']:.1f} % of the decode pairs "
                  "by their routed expert")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", default="0", help="speculated experts per token (0: top-k, the paper's)")
    study_arguments(ap, SYSTEMS)
    args = ap.parse_args(argv)
    run_study(args, [int(s) for s in args.slots.split(",")], accuracy, accuracy_table, hit_lines)


if __name__ == "__main__":
    main()
