"""Measure LLaPor's top-k hit rate on moescope's own trained models at distances 1..3 (held-out sequences): the
figures behind the simulator's default oracle (engine/data/measured_hit_rates.yaml).

Per model, `python -m predictors.train` records the model's ShareGPT routing with gate inputs (or reads `--trace`),
splits it by sequence (25 % test), trains LLaPor at each distance and scores it on the test sequences. The d = 1
run also trains the baselines (stats, transition, gate, token, MoEless) on the same split: the realistic
predictors' marks of the hit-rate sweep. Each run writes runs/predictors/<model>-llapor-d<d>-run/results.json.

    python engine/bench/measure_llapor_hit_rates.py [--models mixtral_tiny,deepseek_tiny] [--distances 1,2,3]
        [--trace mixtral_tiny=<trace.npz>] [--batches deepseek_tiny=16] [--write]

About 2 minutes per (model, distance) on 2 cores, plus the recording and the d = 1 baselines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DROP_BASELINES = [f"~predictor@baselines.{k}" for k in ("stats", "gate", "token", "moeless", "oracle")]


def run_dir(model: str, d: int) -> Path:
    return ROOT / "runs" / "predictors" / f"{model.replace('_', '-')}-llapor-d{d}-run"


def train(model: str, d: int, trace: str | None, batches: int | None) -> dict[str, Any]:
    """One `predictors.train` run of LLaPor at distance `d` (the baselines too at d = 1); its results.json."""
    out = run_dir(model, d)
    cmd = [sys.executable, "-m", "predictors.train", f"model={model}", "predictor=llapor", f"predictor.distance={d}",
           "shift=false", "online=false", "plots=false", "wandb.mode=disabled", f"hydra.run.dir={out}",
           f"out=pkg:runs/predictors/{model.replace('_', '-')}-llapor_d{d}"]
    cmd += ["+predictor@baselines.transition=transition"] if d == 1 else DROP_BASELINES
    if trace:
        cmd.append(f"trace={trace}")
    elif batches:
        cmd.append(f"workload.num_batches={batches}")
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads((out / "results.json").read_text())


def yaml_value(v: Any) -> str:
    return "null" if v is None else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mixtral_tiny,deepseek_tiny")
    ap.add_argument("--distances", default="1,2,3")
    ap.add_argument("--trace", action="append", default=[], metavar="MODEL=PATH", help="a recorded trace.npz")
    ap.add_argument("--batches", action="append", default=["deepseek_tiny=16"], metavar="MODEL=N",
                    help="ShareGPT batches to record (predictors.train's default: 32)")
    ap.add_argument("--write", action="store_true", help="rewrite the llapor hit rates in measured_hit_rates.yaml")
    args = ap.parse_args()
    traces = dict(t.split("=", 1) for t in args.trace)
    batches = {k: int(v) for k, v in (b.split("=", 1) for b in args.batches)}
    distances = [int(d) for d in args.distances.split(",")]
    measured: dict[str, dict[int, float]] = {}
    for model in args.models.split(","):
        trace = traces.get(model)
        for d in distances:
            res = train(model, d, trace, batches.get(model))
            measured.setdefault(model, {})[d] = round(res["methods"]["llapor"]["test"]["groups"]["all"]["hit"], 4)
            if d == 1:
                marks = {n.split("@")[0]: round(m["test"]["groups"]["all"]["hit"], 4) for n, m in res["methods"].items()
                         if m["distance"] == 1 and m["kind"] != "oracle"}
                print(f"{model} d = 1 on the same test split: {marks}")
            trace = trace or str(run_dir(model, distances[0]) / "trace.npz")  # later distances: the same routing
    print("\nLLaPor top-k hit rate, held-out test sequences")
    print("| model | " + " | ".join(f"d = {d}" for d in distances) + " |")
    print("|---|" + "---|" * len(distances))
    for model, by_d in measured.items():
        print(f"| {model} | " + " | ".join(f"{by_d[d]:.4f}" for d in distances) + " |")
    if args.write:
        from omegaconf import OmegaConf

        from engine.sim.measured import MEASURED_FILE

        # a plain rewrite of the numbers only: the comments of the file stay as they are
        text = MEASURED_FILE.read_text()
        data = OmegaConf.load(MEASURED_FILE)
        for model, by_d in measured.items():
            old = OmegaConf.to_container(data.llapor[model].hit_rate)
            new = {**old, **by_d}  # type: ignore[dict-item]
            before = "{" + ", ".join(f"{d}: {yaml_value(v)}" for d, v in old.items()) + "}"  # type: ignore[union-attr]
            after = "{" + ", ".join(f"{d}: {yaml_value(v)}" for d, v in new.items()) + "}"
            text = text.replace(f"hit_rate: {before}", f"hit_rate: {after}", 1)
        MEASURED_FILE.write_text(text)
        print(f"written: {MEASURED_FILE}")


if __name__ == "__main__":
    main()
