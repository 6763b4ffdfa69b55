"""Benchmark: Horizon's prefetch across the decode-step boundary (`next_step_layers`) and the bound with the cache
carried from pass to pass (`engine.sim.bounds.continuity_bound`), at study points.

At every point (the Horizon study's settings: transition-table forecasts, the Figure-11 prompt and length) Horizon-1
(one batch in flight: at batch 2b it serves, bit for bit, what Horizon serves at b, so the sweep's batches 8-64 are
the study's equal-concurrency points) runs with each `--values` setting of `next_step_layers` on the same routing, and
the run's time is set against the per-pass bound (`lower_bound`: each pass from the best cache for its own routing)
and the continuity bound (still clairvoyant about the routing; the cache carried over), with the slots both use and
the most hits a carried cache can give the decode passes against the per-pass bound's (slots x passes):

    python engine/bench/bench_cross_step.py [--points mixtral_8x7b:a100_pcie4:8,mixtral_8x7b:a100_pcie4:64:trained_tiny]
        [--values 0,1,2] [--seed 0]

It also sets each run against the segment bound (`engine.sim.bounds.segment_bound`: whole per-layer splits, the
slots charged per segment of layers); `--values ''` computes the three bounds alone (no run, seconds a point):

    python engine/bench/bench_cross_step.py --values '' [--points ...]

`--points` model:machine:batch[:routing]; default: the four models on both machines at batches 8-64 (the 32 sweep
points of the study's equal-concurrency table) and Mixtral's trained_tiny replays at the same batches (the other 8).
The simulator is deterministic: the results do not depend on the load; the wall time does.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.bench.bench_horizon_study import HARDWARE, MODELS, Point, point_spec  # noqa: E402
from engine.bench.bench_simulate_sweep import scheduler_settings  # noqa: E402
from engine.sim.bounds import continuity_bound, lower_bound, most_hits, segment_bound  # noqa: E402
from engine.sim.run import build_sim, prepare_routing, simulate  # noqa: E402

EQUAL = (8, 16, 32, 64)  # Horizon-1's batches that are Horizon's b4-b32 (the equal-concurrency table)


def default_points() -> list[str]:
    out = [f"{m}:{hw}:{b}" for m in MODELS for hw in HARDWARE for b in EQUAL]
    return out + [f"mixtral_8x7b:{hw}:{b}:trained_tiny" for hw in HARDWARE for b in EQUAL]


def measure(text: str, values: list[int], seed: int) -> dict[str, Any]:
    """One point: Horizon-1's throughput per `next_step_layers` value, its time against both bounds."""
    model, machine, batch, routing_name = (text.split(":") + ["synthetic"])[:4]
    point = Point("sweep" if routing_name == "synthetic" else "replay", model, machine, int(batch),
                  routing=routing_name)
    base = scheduler_settings("horizon_1")
    spec = replace(point_spec(point, seed), scheduler=base)
    routing = prepare_routing(spec)
    row: dict[str, Any] = {"point": text}
    for value in values:
        begin = time.perf_counter()
        out = simulate(replace(spec, scheduler=replace(base, next_step_layers=value)), routing)
        row[value] = (out.summary["throughput_tok_s"], out.summary["total_s"], time.perf_counter() - begin)
    _, memory, cost = build_sim(spec, routing)  # the run's slots and costs, without running it
    slots = memory.cache_slots + spec.scheduler.staging_slots
    decode = [fp.loads for fp in routing.passes if not fp.prefill]
    begin = time.perf_counter()
    segments = segment_bound(spec.model, cost, routing.passes, slots)
    row.update(slots=slots, hits=most_hits(decode, slots), per_pass_hits=slots * len(decode),
               lower=lower_bound(spec.model, cost, routing.passes, slots),
               carried=continuity_bound(spec.model, cost, routing.passes, slots),
               segments=segments, segment_s=time.perf_counter() - begin)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=",".join(default_points()))
    ap.add_argument("--values", default="0,1",
                    help="next_step_layers settings; the first is the reference; '' for the bounds alone")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    values = [int(v) for v in args.values.split(",") if v.strip()]
    head = ["point", *(f"tok/s n={v}" for v in values), *(["change"] if values else []), "slots",
            "decode hits, carried / per pass", "above per-pass bound", "above continuity bound", "above segment bound",
            "segment bound over per-pass"]
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    changes = []
    start = time.perf_counter()
    for text in args.points.split(","):
        row = measure(text, values, args.seed)
        print(point_line(row, values), flush=True)
        thr = [row[v][0] for v in values]
        changes += [t / thr[0] - 1 for t in thr[1:]]
    if changes:
        changes.sort()
        print(f"\nthroughput change against n={values[0]}: median {100 * changes[len(changes) // 2]:+.3f} %, min "
              f"{100 * changes[0]:+.3f} %, max {100 * changes[-1]:+.3f} % over {len(changes)}")
    print(f"{time.perf_counter() - start:.0f} s wall")


def point_line(row: dict[str, Any], values: list[int]) -> str:
    """One point's table line: throughput per setting, its change, the hits, the run over each bound."""
    thr = [row[v][0] for v in values]
    runs = [f"{t:.4f}" for t in thr] + ([", ".join(f"{100 * (t / thr[0] - 1):+.3f} %" for t in thr[1:])] if values
                                       else [])
    above = [f"{100 * (row[values[0]][1] / row[k] - 1):.2f} %" if values else "-" for k in ("lower", "carried",
                                                                                         "segments")]
    cells = [row["point"], *runs, str(row["slots"]), f"{row['hits']} / {row['per_pass_hits']}", *above,
             f"{100 * (row['segments'] / row['lower'] - 1):+.3f} % ({row['segment_s']:.1f} s)"]
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
