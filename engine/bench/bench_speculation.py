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

from engine.bench.bench_deferral import POINTS, throughput, throughput_table  # noqa: E402

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


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mixtral-tiny,deepseek-tiny")
    ap.add_argument("--slots", default="0", help="speculated experts per token (0: top-k, the paper's)")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--points", default=POINTS)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    if not args.skip_accuracy:
        rows = accuracy(args.models.split(","), [int(s) for s in args.slots.split(",")], args.windows, args.length)
        print(f"held-out text: {args.windows} windows of {args.length} tokens per model, teacher-forced")
        print(accuracy_table(rows), flush=True)
    if not args.skip_throughput:
        systems = args.systems.split(",")
        print("simulator, seed 0, tok/s (decode step)")
        rows = throughput(args.points.split(","), systems)
        print(throughput_table(rows, systems))
        for r in rows:  # what the speed costs: decode (token, slot) pairs computed by their routed expert
            if r["system"] == "speculative" and "error" not in r:
                print(f"{r['point']}: speculative execution computed {100 * r['pairs_hit']:.1f} % of the decode pairs "
                      "by their routed expert")
    print(f"wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
