"""Benchmark: time the latency-memory frontier study, a Hydra multirun under the joblib launcher, and report it.

    python engine/bench/bench_serverless_frontier.py [--models mixtral_8x7b,phi35_moe,llama4_scout] [--seeds 0,1,2,3,4]
        [--duration-s 10] [--workers 2] [--out runs/bench/serverless_frontier] [--set key=value ...]

A thin timer: it runs `python -m engine.serve -m +experiment=serverless_frontier` (one engine.serve job per
(model, seed), `conf/experiment/serverless_frontier.yaml`; the joblib launcher runs `--workers` at a time) into
`--out`, then `python -m engine.report --out` builds its tables and figures (engine.serverless.frontier), and
prints the wall time. Rerunning with the same `--out` skips the finished jobs (job_complete.json).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODELS = ("mixtral_8x7b", "phi35_moe", "llama4_scout")


def multirun_command(models: str, seeds: str, duration_s: float, workers: int, out: Path,
                     extra: Iterable[str] = ()) -> list[str]:
    """The engine.serve multirun of the frontier study over `models` x `seeds`."""
    return [sys.executable, "-m", "engine.serve", "-m", "+experiment=serverless_frontier", f"model={models}",
            f"seed={seeds}", f"workload.azure.duration_s={duration_s:g}", f"hydra.sweep.dir={out}",
            f"hydra.launcher.n_jobs={workers}", *extra]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="runs/bench/serverless_frontier")
    ap.add_argument("--set", action="append", default=[], help="extra engine.serve override (repeatable)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    t0 = time.perf_counter()
    subprocess.run(multirun_command(a.models, a.seeds, a.duration_s, a.workers, out, a.set), check=True)
    wall = time.perf_counter() - t0
    subprocess.run([sys.executable, "-m", "engine.report", str(out)], check=True)
    print(f"multirun wall {wall:.0f} s ({a.workers} joblib workers); report: {out / 'report.md'}")


if __name__ == "__main__":
    main()
