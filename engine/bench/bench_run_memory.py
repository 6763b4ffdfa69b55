"""`engine.run`'s anonymous memory over a run, variants alternated: is it flat, and where is its peak?

Each run is `python -m engine.run` on one model file (a GGUF file of `engine.bench.full_depth_gguf`, any depth) in
its own process, sampled from outside every 20 ms; engine.run itself reports its anonymous memory after loading,
after the warm-up and after the measured batches (`anon_growth_serving_bytes`: what the measured batches added).
Variants run in turn, the order flipped every round (timings under load: read the ratios within a round):

    python -m engine.bench.bench_run_memory /tmp/mem/qwen3_moe-L12-q4_k_m-random.gguf --rounds 2 \\
        --variant "default" --variant "no mmap threshold|offload.host_mmap_threshold_kib=null" \\
        --variant "before|offload.host_mmap_threshold_kib=null|/tmp/base-checkout"

A variant is "label|overrides (space-separated)|checkout" (overrides and checkout optional; a checkout runs its own
code, e.g. a `git worktree` of an older commit with its native library built).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from engine.bench.bench_full_depth import REPO, run_watched

GB = 1e9


def parse_variant(text: str) -> dict[str, Any]:
    parts = text.split("|")
    if len(parts) > 3 or not parts[0]:
        raise ValueError(f"--variant {text!r}: expected 'label|overrides|checkout' (the last two optional)")
    tree = Path(parts[2]) if len(parts) > 2 and parts[2] else REPO
    if not (tree / "engine" / "run.py").is_file():
        raise ValueError(f"--variant {text!r}: {tree} is not a moescope checkout (no engine/run.py)")
    return {"label": parts[0], "overrides": parts[1].split() if len(parts) > 1 else [], "tree": tree}


def run_once(a: argparse.Namespace, variant: dict[str, Any], tag: str) -> dict[str, Any]:
    """One engine.run of `variant`: the sampled peaks, and the results' memory phases and decode rate."""
    name = f"{tag}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', variant['label'])}"  # a Hydra override takes no brackets
    run_dir = Path(a.out) / name
    cmd = [sys.executable, "-m", "engine.run", f"model.checkpoint={a.model}", "model.arch=null", "model.name=bench",
           "compare_in_memory=false", f"workload.batch_size={a.batch}", f"workload.num_batches={a.batches}",
           f"workload.prompt_len={a.prompt}", f"workload.gen_len={a.new + 1}", "wandb.mode=disabled",
           f"hydra.run.dir={run_dir}", *variant["overrides"]]
    env = {**os.environ, "PYTHONPATH": str(variant["tree"])}
    run = run_watched(cmd, Path(a.out) / f"{name}.log", a.timeout, env, cwd=variant["tree"])
    path = run_dir / "results.json"
    d = json.loads(path.read_text()) if path.is_file() else {}
    keys = ("decode_tokens_per_s", "anon_after_load_bytes", "anon_after_warm_up_bytes", "anon_after_serving_bytes",
            "anon_growth_serving_bytes")
    return {**run, **{k: d.get(k) for k in keys}, "load": os.getloadavg()[0]}


def median(rows: list[dict], key: str) -> Optional[float]:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return float(np.median(xs)) if xs else None


def table(results: dict[str, list[dict]]) -> str:
    """Per variant the median over rounds; the last column its peak against the first variant's in the same round."""
    head = ["variant", "peak anon GB", "after load GB", "after warm-up GB", "after serving GB", "growth serving MB",
            "decode tok/s", "peak / first"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    first = next(iter(results.values()))

    def cell(v: Optional[float], scale: float, spec: str) -> str:
        return "-" if v is None else format(v / scale, spec)

    for label, rows in results.items():
        ratios = [r["peak_anon_bytes"] / f["peak_anon_bytes"] for r, f in zip(rows, first) if f["peak_anon_bytes"]]
        lines.append("| " + " | ".join([
            label, cell(median(rows, "peak_anon_bytes"), GB, ".3f"), cell(median(rows, "anon_after_load_bytes"), GB, ".3f"),
            cell(median(rows, "anon_after_warm_up_bytes"), GB, ".3f"),
            cell(median(rows, "anon_after_serving_bytes"), GB, ".3f"),
            cell(median(rows, "anon_growth_serving_bytes"), 1e6, "+.0f"), cell(median(rows, "decode_tokens_per_s"), 1, ".2f"),
            f"{np.median(ratios):.3f}" if ratios else "-"]) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="model.checkpoint of every run (a GGUF file, a checkpoint folder)")
    ap.add_argument("--variant", action="append", default=None,
                    help="'label|overrides|checkout' (repeat; default: this checkout as it is)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=2, help="measured batches (workload.num_batches)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="/tmp/bench_run_memory")
    a = ap.parse_args(argv)
    if not Path(a.model).exists():
        raise SystemExit(f"model {a.model}: no such file or folder")
    try:
        variants = [parse_variant(v) for v in (a.variant or ["moescope"])]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    Path(a.out).mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {v["label"]: [] for v in variants}
    for r in range(a.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            t = time.time()
            row = run_once(a, v, f"r{r}")
            results[v["label"]].append(row)
            print(f"round {r + 1} {v['label']}: rc {row['rc']}, peak {row['peak_anon_bytes'] / GB:.3f} GB, growth "
                  f"serving {(row['anon_growth_serving_bytes'] or 0) / 1e6:+.0f} MB, decode "
                  f"{row['decode_tokens_per_s'] or 0:.2f} tok/s, load {row['load']:.1f} ({time.time() - t:.0f} s)",
                  flush=True)
    # a run that failed has no results: the table shows what the others measured
    for label, rows in results.items():
        results[label] = [x for x in rows if x["rc"] == 0] or rows
    print(table(results))
    (Path(a.out) / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
