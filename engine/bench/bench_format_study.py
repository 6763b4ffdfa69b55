"""How the comparison between offload schedulers moves from bf16 to Q8_0 to Q4_K_M experts (issue 28, item 7).

    python engine/bench/bench_format_study.py                       # every point, 1 seed, 2 workers
    python engine/bench/bench_format_study.py --points fig11 --formats bf16,q4_k_m --seeds 0,1

The simulator replays one routing per (point, seed) with the routed experts in each `--formats`
(`model.expert_format`, schedulers/formats.py: an expert's bytes for the link, the device cache and the GPU's
streaming; its CPU time from the native kernels' measured rates against bf16, schedulers/data/block_rates.yaml)
under every `--systems` policy, with the transition-table predictor fitted on held-out routing (real forecasts).
Points: the Figure-11 point (Mixtral-8x7B, A100 PCIe 4.0, batch 64, LayerScope's calibrated machine: the PreSched
regimes study's `calibrated` point) and rows of that study (engine/bench/bench_presched_regimes.py): the link at
x0.25 and x0.5, batch 4 and 16, and an expert cache of 10 % -- here 10 % of the model's bf16 expert BYTES, so a
quantized format holds more experts in the same memory, as the memory plan gives it everywhere else.

Prints one table: per point and format the cache (experts), t_io and the CPU time of one expert at m = 1, each
system's decode throughput (tok/s), the best system and Horizon's lead over the best other. Writes the rows to
`--out`/rows.json. Asserts nothing. Simulated (no GPU is needed): the numbers are the cost model's, see the README.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from multiprocessing import Pool
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.bench.bench_presched_regimes import base_spec, profile, regime_named  # noqa: E402
from engine.bench.bench_simulate_sweep import scheduler_settings, sweep_predictor  # noqa: E402
from engine.sim.run import prepare_routing, simulate  # noqa: E402
from schedulers.formats import expert_format_bytes  # noqa: E402

POINTS = {"fig11": "calibrated", "link_x0.25": "link_bandwidth_x0_25", "link_x0.5": "link_bandwidth_x0_5",
          "batch_4": "batch_4", "batch_16": "batch_16", "cache_10pct": "expert_cache_10pct_of_experts"}
LABELS = {"fig11": "Figure 11: Mixtral-8x7B, A100, b64 (calibrated)", "link_x0.25": "link x0.25",
          "link_x0.5": "link x0.5", "batch_4": "batch 4", "batch_16": "batch 16",
          "cache_10pct": "cache 10 % of the bf16 experts' bytes"}
FORMATS = ("bf16", "q8_0", "q4_k_m")
SYSTEMS = ("horizon", "presched", "klotski", "hybrimoe", "fiddler")


def run_point(args: tuple[str, int, tuple[str, ...], tuple[str, ...], str]) -> list[dict[str, Any]]:
    """Every format x system on one (point, seed)'s routing (Klotski, two batches in flight, on its own)."""
    point, seed, formats, systems, forecasts = args
    regime = regime_named(POINTS[point])
    base = replace(base_spec(regime.batch, seed), hardware=profile(regime), predictor=sweep_predictor(forecasts))
    routings: dict[int, Any] = {}
    rows = []
    for fmt in formats:
        spec = replace(base, expert_format=fmt)
        if regime.cache_fraction is not None:  # the same memory: a fraction of the bf16 experts' bytes
            experts = spec.model.num_experts * len(spec.model.moe_layers)
            share = expert_format_bytes(spec.model, "bf16") / expert_format_bytes(spec.model, fmt)
            spec = replace(spec, cache_slots=min(int(round(regime.cache_fraction * experts * share)), experts))
        for system in systems:
            run = replace(spec, scheduler=scheduler_settings(system))
            if run.sequences not in routings:
                routings[run.sequences] = prepare_routing(run)
            t0 = time.process_time()
            out = simulate(run, routings[run.sequences])
            rows.append({"point": point, "seed": seed, "format": fmt, "system": system, "forecasts": forecasts,
                         "throughput_tok_s": out.summary["throughput_tok_s"],
                         "decode_latency_s": out.summary["decode_latency_s"], "cache_slots": out.summary["cache_slots"],
                         "t_io_ms": out.cost.t_io * 1e3, "t_c1_ms": float(out.cost.t_c(1)) * 1e3,
                         "t_g1_ms": float(out.cost.t_g(1)) * 1e3, "expert_mib": out.cost.expert_bytes / 2**20,
                         "sim_cpu_s": time.process_time() - t0})
            print(f"  {point} seed {seed} {fmt:7s} {system:9s} {rows[-1]['throughput_tok_s']:8.2f} tok/s "
                  f"({rows[-1]['sim_cpu_s']:.0f} s)", flush=True)
    return rows


def table(rows: list[dict[str, Any]], systems: tuple[str, ...]) -> str:
    """Markdown: one row per (point, format), throughput per system (mean over seeds)."""
    import numpy as np

    keys = list(dict.fromkeys((r["point"], r["format"]) for r in rows))
    head = ["point", "format", "cache (experts)", "t_io ms", "CPU expert m=1 ms", *systems, "best", "Horizon vs best other"]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for point, fmt in keys:
        sub = [r for r in rows if (r["point"], r["format"]) == (point, fmt)]
        thr = {s: float(np.mean([r["throughput_tok_s"] for r in sub if r["system"] == s])) for s in systems
               if any(r["system"] == s for r in sub)}
        first = sub[0]
        best = max(thr, key=thr.get)
        others = [v for s, v in thr.items() if s != "horizon"]
        lead = f"{thr['horizon'] / max(others) - 1:+.1%}" if "horizon" in thr and others else "—"
        cells = [LABELS.get(point, point), fmt, str(first["cache_slots"]), f"{first['t_io_ms']:.2f}",
                 f"{first['t_c1_ms']:.2f}", *(f"{thr[s]:.2f}" if s in thr else "—" for s in systems), best, lead]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=",".join(POINTS), help=f"comma-separated, of {', '.join(POINTS)}")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--forecasts", default="transition", help="transition | stats | measured | a hit rate")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="runs/bench/format_study")
    a = ap.parse_args(argv)
    points = [p for p in a.points.split(",") if p]
    unknown = [p for p in points if p not in POINTS]
    if unknown:
        raise SystemExit(f"--points: unknown {unknown}; known: {', '.join(POINTS)}")
    formats, systems = tuple(a.formats.split(",")), tuple(a.systems.split(","))
    jobs = [(p, int(s), formats, systems, a.forecasts) for p in points for s in a.seeds.split(",")]
    start = time.perf_counter()
    if a.workers > 1:
        with Pool(min(a.workers, len(jobs))) as pool:
            rows = [r for part in pool.imap_unordered(run_point, jobs) for r in part]
    else:
        rows = [r for job in jobs for r in run_point(job)]
    order = {p: i for i, p in enumerate(points)}
    rows.sort(key=lambda r: (order[r["point"]], formats.index(r["format"]), r["seed"]))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\n{table(rows, systems)}\n\nforecasts: {a.forecasts}; seeds {a.seeds}; "
          f"{time.perf_counter() - start:.0f} s; rows in {out / 'rows.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
