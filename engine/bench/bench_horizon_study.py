"""Study: every offload policy at every point, mean ± std over seeds, the gap to the lower bound, drawn.

Points: the Figure-11 sweep (4 models x 2 machines x 5 batches, synthetic routing fitted to real Mixtral
statistics), the rows of `bench_presched_regimes` (Mixtral-8x7B, A100, one cost moved at a time), and the routing of
the shipped trained mixtral-tiny (`routing=trained_tiny`) at batches 4-64. Forecasts are realistic: the transition
table fitted on held-out routing (`study.forecasts=transition`); `study.forecasts=measured` runs the default oracle
(LLaPor's measured hit rate: an upper bound, labelled so).

Bound: `engine.sim.bounds.lower_bound` of the point's passes, which knows the routing of the whole pass (what no
forecast does). A policy that keeps two batches in flight (Klotski, Horizon) replays twice the sequences per pass,
so each in-flight width has its own bound; the point's bound is the best throughput any schedule with at most two
batches in flight could reach (`bound_tok_s`), and `above_lower_bound` of a run is its time over the bound of its own
passes minus 1. The gap Horizon closes at a point is (Horizon - best other) / (bound - best other) in throughput.
Each run also records two tighter bounds of its own passes, still clairvoyant about the routing, each with its own
report section: `continuity_bound_s` (the cache carried from pass to pass) and `segment_bound_s` (whole per-layer
splits, the slots charged per segment of layers).

The study is three Hydra multiruns of `engine.simulate` jobs of kind `horizon` (one job per point and seed, any
launcher, resumable), one per set of points, and one report over the folder that holds them:

    python -m engine.simulate -m +experiment=horizon_study   hydra.sweep.dir=runs/horizon/sweep
    python -m engine.simulate -m +experiment=horizon_regimes hydra.sweep.dir=runs/horizon/regimes
    python -m engine.simulate -m +experiment=horizon_replay  hydra.sweep.dir=runs/horizon/replay
    python -m engine.report runs/horizon     # points x policies, the bound distribution, the figure; wandb

This script runs them under joblib into `--out`/<set> (a rerun resumes; `--fresh` starts over), times them and
prints the report:

    python engine/bench/bench_horizon_study.py [--seeds 0,1,2,3,4] [--sets sweep,regimes,replay]
        [--models ...] [--batches ...] [--systems ...] [--workers 2] [--out runs/bench/horizon_study]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from conf import compose  # noqa: E402
from engine.bench.bench_presched_regimes import REGIMES, profile, regime_named  # noqa: E402
from engine.bench.bench_simulate_sweep import BATCHES, HARDWARE, MODELS, hardware, scheduler_settings, \
    sweep_predictor  # noqa: E402
from engine.sim.bounds import continuity_bound, lower_bound, segment_bound  # noqa: E402
from engine.sim.run import PreparedRouting, RunSpec, prepare_routing, simulate  # noqa: E402
from engine.simulate import spec_from_config  # noqa: E402

SYSTEMS = ("horizon", "presched", "hybrimoe", "klotski", "dali", "layerwise", "fiddler", "fate", "ktransformers",
           "ondemand", "lru")
OURS = "horizon"


@dataclass(frozen=True)
class Point:
    """One point of the study: a model on a machine at a batch, under a routing, with some costs changed."""

    set: str  # sweep | regimes | replay
    model: str
    machine: str
    batch: int
    routing: str = "synthetic"
    regime: Optional[str] = None  # bench_presched_regimes "axis: setting"
    forecasts: str = "transition"

    @property
    def label(self) -> str:
        where = self.regime or f"{self.model} {self.machine} b{self.batch}"
        return f"{self.set}: {where}" + (f" ({self.routing})" if self.routing != "synthetic" else "")


def study_points(sets: tuple[str, ...] = ("sweep", "regimes", "replay"), models: tuple[str, ...] = tuple(MODELS),
                 batches: tuple[int, ...] = tuple(BATCHES), forecasts: str = "transition") -> list[Point]:
    """Every point of the study, in table order."""
    out: list[Point] = []
    if "sweep" in sets:
        out += [Point("sweep", m, hw, b, forecasts=forecasts) for m in models for hw in HARDWARE for b in batches]
    if "regimes" in sets:
        out += [Point("regimes", "mixtral_8x7b", "a100_pcie4", r.batch, regime=f"{r.axis}: {r.setting}",
                      forecasts=forecasts) for r in REGIMES if r.forecasts != ("0.5",) and r.forecasts != ("1.0",)]
    if "replay" in sets:
        out += [Point("replay", "mixtral_8x7b", hw, b, routing="trained_tiny", forecasts=forecasts)
                for hw in HARDWARE for b in batches]
    return out


SETS = ("sweep", "regimes", "replay")
EXPERIMENTS = {"sweep": "horizon_study", "regimes": "horizon_regimes", "replay": "horizon_replay"}


def point_spec(point: Point, seed: int) -> RunSpec:
    """The point's run spec under PreSched (each system replaces the scheduler)."""
    cfg = compose("simulate", [f"model={point.model}", f"batch_size={point.batch}", f"routing={point.routing}",
                               "scheduler=presched"])
    spec = replace(spec_from_config(cfg), hardware=hardware(point.machine), predictor=sweep_predictor(point.forecasts),
                   seed=seed)
    return regime_costs(point, spec)


def regime_costs(point: Point, spec: RunSpec) -> RunSpec:
    """`spec` with the costs of the point's PreSched regime (machine, batch, expert cache); as it is without one."""
    if point.regime is None:
        return spec
    regime = next(r for r in REGIMES if f"{r.axis}: {r.setting}" == point.regime)
    spec = replace(spec, hardware=profile(regime), batch_size=regime.batch)
    if regime.cache_fraction is not None:
        experts = spec.model.num_experts * len(spec.model.moe_layers)
        spec = replace(spec, cache_slots=int(round(regime.cache_fraction * experts)))
    return spec


def run_point(point: Point, seed: int, systems: tuple[str, ...] = SYSTEMS) -> list[dict[str, Any]]:
    """Every system at one point on one seed's routing (one routing per in-flight width), with the bounds."""
    return point_rows(point, point_spec(point, seed), systems)


def job_rows(cfg: Any) -> list[dict[str, Any]]:
    """The rows of one study job (`engine.simulate` with `study.kind=horizon`): the point is the job's own
    config (model, hardware, batch, routing, seed; `study.regime` a PreSched regime's costs instead), every
    `study.systems` policy planning from `study.forecasts`."""
    from hydra.core.hydra_config import HydraConfig

    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    base = spec_from_config(cfg)
    study = cfg.study
    forecasts = str(study.forecasts)
    model, machine = choices.get("model") or base.model_name, choices.get("hardware") or base.hardware.name
    if study.regime:
        regime = regime_named(str(study.regime))
        point = Point("regimes", model, machine, regime.batch, regime=f"{regime.axis}: {regime.setting}",
                      forecasts=forecasts)
    else:
        point = Point("sweep" if base.routing.name == "synthetic" else "replay", model, machine, base.batch_size,
                      routing=base.routing.name, forecasts=forecasts)
    spec = replace(base, scheduler=scheduler_settings("presched"), predictor=sweep_predictor(forecasts))
    return point_rows(point, regime_costs(point, spec), tuple(str(s) for s in study.systems) or SYSTEMS)


def point_rows(point: Point, base: RunSpec, systems: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every system at one point on `base`'s routing (one routing per in-flight width), with the bounds."""
    routings: dict[int, Any] = {}
    bounds: dict[int, float] = {}
    carried: dict[int, float] = {}  # the bound with the cache carried from pass to pass (`continuity_bound`)
    segments: dict[int, float] = {}  # the bound with whole per-layer splits and slots per segment (`segment_bound`)
    where = {"study": "horizon", "point": point.label, "set": point.set, "model": point.model,
             "machine": point.machine, "batch": point.batch, "regime": point.regime, "seed": base.seed}
    rows = []
    for system in systems:
        spec = replace(base, scheduler=scheduler_settings(system))
        try:
            routing = routings.get(spec.sequences) or share_fits(prepare_routing(spec), routings.values())
            routings[spec.sequences] = routing
            t0 = time.process_time()
            out = simulate(spec, routing)
        except ValueError as err:  # e.g. two batches' KV cache does not fit the device
            rows.append({**where, "system": system, "error": str(err)})
            continue
        if spec.sequences not in bounds:
            slots = out.memory.cache_slots + spec.scheduler.staging_slots
            bounds[spec.sequences] = lower_bound(spec.model, out.cost, routing.passes, slots)
            carried[spec.sequences] = continuity_bound(spec.model, out.cost, routing.passes, slots)
            segments[spec.sequences] = segment_bound(spec.model, out.cost, routing.passes, slots)
        tokens = sum(p.num_seqs for p in routing.passes)
        lb = bounds[spec.sequences]
        rows.append({**where, "system": system,
                     "label": spec.scheduler.label, "in_flight": spec.scheduler.in_flight,
                     "throughput_tok_s": out.summary["throughput_tok_s"],
                     "decode_latency_s": out.summary["decode_latency_s"], "total_s": out.summary["total_s"],
                     "lower_bound_s": lb, "bound_tok_s": tokens / lb, "above_lower_bound": out.summary["total_s"] / lb - 1,
                     "continuity_bound_s": carried[spec.sequences],
                     "above_continuity_bound": out.summary["total_s"] / carried[spec.sequences] - 1,
                     "segment_bound_s": segments[spec.sequences],
                     "above_segment_bound": out.summary["total_s"] / segments[spec.sequences] - 1,
                     "sim_cpu_s": time.process_time() - t0})
    best_bound = max((r["bound_tok_s"] for r in rows if "error" not in r), default=float("nan"))
    for r in rows:
        r["point_bound_tok_s"] = best_bound
    return rows


def share_fits(routing: PreparedRouting, others: Any) -> PreparedRouting:
    """`routing` fitting its predictors once with another width's routing of the point where both hold out the same
    routing (synthetic traffic: the profiling prompts do not depend on the batch in flight)."""
    for other in others:
        a, b = other.train, routing.train
        if a is not None and b is not None and a.num_rows == b.num_rows and all(
                np.array_equal(getattr(a, f), getattr(b, f)) for f in ("experts", "weights", "step", "seq")):
            routing.fitted = other.fitted
            break
    return routing


def newest_runs(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """(one row per (point, seed, system), how many older rows were dropped): where a policy ran again at a point and
    seed (a rerun of one policy beside older all-system runs), the newest run's row wins (its job's `finished` time,
    `engine.report.job_finished`; rows without one count in the order given, the later newer). Every kept row's
    `point_bound_tok_s` is the best bound of its point and seed over the rows kept, as `point_rows` sets it (a
    one-policy job only knows its own in-flight width's bound)."""
    ranked = sorted(enumerate(rows), key=lambda ir: (ir[1].get("finished", -math.inf), ir[0]))
    kept = {(r["point"], r["seed"], r["system"]): r for _, r in ranked}
    best: dict[tuple[str, Any], float] = {}
    for r in kept.values():
        if "error" not in r:
            key = (r["point"], r["seed"])
            best[key] = max(best.get(key, -math.inf), r["bound_tok_s"])
    out = [{**r, "point_bound_tok_s": best.get((r["point"], r["seed"]), r.get("point_bound_tok_s", math.nan))}
           for r in kept.values()]
    return out, len(rows) - len(out)


def point_order(row: dict[str, Any]) -> tuple:
    """A row's point in the study's table order: sets, then models, machines and batches as the Figure-11 sweep
    lists them, regimes as bench_presched_regimes does (a seed's rows keep their order)."""
    regimes = [f"{r.axis}: {r.setting}" for r in REGIMES]
    index = lambda seq, x: seq.index(x) if x in seq else len(seq)
    return (index(list(SETS), row["set"]), index(list(MODELS), row["model"]), index(list(HARDWARE), row["machine"]),
            int(row["batch"]), index(regimes, row.get("regime")), row["seed"])


# ---- tables -----------------------------------------------------------------------------------------------------
def by_point(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        if "error" not in r:
            out.setdefault(r["point"], {}).setdefault(r["system"], []).append(r)
    return out


def rivals(systems: Iterable[str], ours: str) -> list[str]:
    """The other policies among `systems`: neither `ours` nor a variant of it (`horizon_1` is Horizon's own plan with
    one batch in flight, the same plan as Horizon at half the batch: no other policy)."""
    return [s for s in systems if s != ours and not s.startswith(f"{ours}_") and not ours.startswith(f"{s}_")]


def gap_closed(runs: dict[str, list[dict[str, Any]]], ours: str = OURS) -> tuple[float, str, float, float]:
    """(share of the gap between the best other policy and the bound that `ours` closes, the best other, its mean
    throughput, the bound's throughput), all means over seeds."""
    mean = {s: float(np.mean([r["throughput_tok_s"] for r in rs])) for s, rs in runs.items()}
    bound = float(np.mean([r["point_bound_tok_s"] for rs in runs.values() for r in rs]))
    others = {s: mean[s] for s in rivals(mean, ours)}
    if not others:
        return float("nan"), "-", float("nan"), bound
    best = max(others, key=others.__getitem__)
    gap = bound - others[best]
    return ((mean[ours] - others[best]) / gap if gap > 0 and ours in mean else float("nan")), best, others[best], bound


def wins(runs: dict[str, list[dict[str, Any]]], ours: str = OURS) -> bool:
    """`ours` at least every other policy's mean throughput, within one std (of either)."""
    def stats(s: str) -> tuple[float, float]:
        v = [r["throughput_tok_s"] for r in runs[s]]
        return float(np.mean(v)), float(np.std(v))
    m, sd = stats(ours)
    return all(m + max(sd, stats(s)[1]) >= stats(s)[0] for s in rivals(runs, ours))


def point_table(rows: list[dict[str, Any]], systems: tuple[str, ...] = SYSTEMS) -> str:
    """Markdown: points x policies, throughput mean ± std over seeds, the bound, the gap Horizon closes."""
    table = by_point(rows)
    shown = [s for s in systems if any(s in runs for runs in table.values())]
    lines = ["| point | " + " | ".join(shown) + " | bound tok/s | best other | gap closed | Horizon ≥ all |",
             "|---" * (len(shown) + 5) + "|"]
    for point, runs in table.items():
        cells = []
        for s in shown:
            v = [r["throughput_tok_s"] for r in runs.get(s, [])]
            cells.append(f"{np.mean(v):.2f} ± {np.std(v):.2f}" if v else "—")
        if OURS not in runs or len(runs) < 2:  # nothing to compare Horizon with at this point
            lines.append(f"| {point} | " + " | ".join(cells) + " | — | — | — | — |")
            continue
        closed, best, _, bound = gap_closed(runs)
        ok = "yes" if wins(runs) else "**no**"
        lines.append(f"| {point} | " + " | ".join(cells) + f" | {bound:.2f} | {best} | {100 * closed:.0f} % | {ok} |")
    return "\n".join(lines)


def bound_distribution(rows: list[dict[str, Any]], systems: tuple[str, ...] = SYSTEMS) -> str:
    """Markdown: per policy, `above_lower_bound` over every run (its own passes' bound): quantiles."""
    lines = ["| policy | runs | min | 25 % | median | 75 % | max |", "|---|---|---|---|---|---|---|"]
    for s in systems:
        v = np.array([r["above_lower_bound"] for r in rows if r["system"] == s and "error" not in r])
        if v.size:
            q = np.percentile(v, [0, 25, 50, 75, 100])
            lines.append(f"| {s} | {v.size} | " + " | ".join(f"{100 * x:.1f} %" for x in q) + " |")
    return "\n".join(lines)


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    table = by_point(rows)
    closed = [gap_closed(runs)[0] for runs in table.values() if OURS in runs and len(runs) > 1]
    won = [wins(runs) for runs in table.values() if OURS in runs]
    lost = [p for p, runs in table.items() if OURS in runs and not wins(runs)]
    errors = sorted({(r["point"], r["system"]) for r in rows if "error" in r})
    return [f"Horizon at least every other policy (mean, within one std) at {sum(won)} of {len(won)} points"
            + (f"; not at: {', '.join(lost)}" if lost else ""),
            f"gap to the bound closed by Horizon: median {100 * float(np.median(closed)):.0f} %, "
            f"min {100 * float(np.min(closed)):.0f} %, max {100 * float(np.max(closed)):.0f} % over {len(closed)} points"
            if closed else "no gap computed",
            *(f"not run: {s} at {p} (does not fit)" for p, s in errors)]


# ---- at equal concurrency, and with one batch in flight ---------------------------------------------------------
SINGLE = "horizon_1"  # Horizon's plan with one batch in flight (conf/scheduler/horizon_1.yaml)


def concurrency(row: dict[str, Any]) -> int:
    """Sequences a run serves per decode step: its batch x its batches in flight."""
    return int(row["batch"]) * int(row.get("in_flight") or 1)


def paired(runs: dict[str, list[dict[str, Any]]], ours: str) -> dict[str, list[dict[str, Any]]]:
    """`runs` (system -> its runs at one point) on the seeds `ours` ran there only: every policy on the same
    routings."""
    seeds = {r["seed"] for r in runs[ours]}
    kept = {s: [r for r in rs if r["seed"] in seeds] for s, rs in runs.items()}
    return {s: rs for s, rs in kept.items() if rs}


def by_concurrency(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Point at C sequences in flight -> system -> its runs serving C sequences a step (Horizon at batch b with two
    batches in flight beside a one-batch policy at 2b), at every C where every policy of the point's family (set,
    model, machine, regime) ran, in the study's order. Each run's `point_bound_tok_s` becomes the bound of its own
    passes: at one C every policy replays passes of C sequences, so that is the bound any schedule serving C
    sequences a step could reach."""
    family = lambda r: (r["set"], r["model"], r["machine"], r.get("regime"))
    systems: dict[tuple, set[str]] = {}
    at: dict[tuple, dict[str, list[dict[str, Any]]]] = {}
    for r in sorted((r for r in rows if "error" not in r), key=point_order):
        key = (*family(r), concurrency(r))
        systems.setdefault(family(r), set()).add(r["system"])
        at.setdefault(key, {}).setdefault(r["system"], []).append({**r, "point_bound_tok_s": r["bound_tok_s"]})
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    order = lambda kv: (lambda o: (*o[:3], o[4], kv[0][-1]))(point_order(next(iter(kv[1].values()))[0]))
    for key, runs in sorted(at.items(), key=order):
        if set(runs) == systems[key[:-1]] and len(runs) > 1:
            label = re.sub(r" b\d+\b", f", {key[-1]} sequences", next(iter(runs.values()))[0]["point"], count=1)
            out[label] = runs
    return out


def versus_table(table: dict[str, dict[str, list[dict[str, Any]]]], ours: str, systems: tuple[str, ...],
                 metric: str = "throughput_tok_s") -> str:
    """Markdown: points x policies, `metric` mean ± std over `ours`' seeds at each point, then for throughput the bound
    of the point's passes, the best other policy, `ours` over it, the gap to the bound `ours` closes and whether `ours`
    is at least every other policy within one std; for the decode step (`decode_latency_s`) `ours`' step over that
    of the best other policy by throughput and over the shortest other step."""
    shown = [s for s in systems if any(s in runs for runs in table.values())]
    thr = metric == "throughput_tok_s"
    tail = (f"bound tok/s | best other | {ours} / best | gap closed | {ours} ≥ all" if thr else
            f"best other (tok/s) | {ours} / its step | shortest other | {ours} / shortest")
    lines = [f"| point | {' | '.join(shown)} | {tail} |", "|---" * (len(shown) + 5) + "|"]
    for point, runs in table.items():
        if ours not in runs:
            continue
        runs = paired(runs, ours)
        mean = {s: float(np.mean([r[metric] for r in rs])) for s, rs in runs.items()}
        cells = [f"{mean[s]:.{2 if thr else 3}f} ± {np.std([r[metric] for r in runs[s]]):.{2 if thr else 3}f}"
                 if s in runs else "—" for s in shown]
        closed, best, _, bound = gap_closed(runs, ours)
        if thr:
            ends = [f"{bound:.2f}", best, f"{mean[ours] / mean[best]:.3f}", f"{100 * closed:.0f} %",
                    "yes" if wins(runs, ours) else "**no**"]
        else:
            shortest = min((s for s in mean if s != ours), key=mean.__getitem__)
            ends = [best, f"{mean[ours] / mean[best]:.3f}", shortest, f"{mean[ours] / mean[shortest]:.3f}"]
        lines.append(f"| {point} | " + " | ".join(cells + ends) + " |")
    return "\n".join(lines)


def versus_summary(table: dict[str, dict[str, list[dict[str, Any]]]], ours: str, whom: str) -> list[str]:
    """Lines: at how many points `ours` is at least `whom` (mean, within one std), where not, and the spread of its
    throughput and decode step over the best other's and of the gap it closes."""
    table = {p: paired(runs, ours) for p, runs in table.items() if ours in runs}
    if not table:
        return []
    lost = [p for p, runs in table.items() if not wins(runs, ours)]
    mean = lambda rs, m: float(np.mean([r[m] for r in rs]))
    ratio = lambda m: [mean(runs[ours], m) / mean(runs[gap_closed(runs, ours)[1]], m) for runs in table.values()]
    spread = lambda v, pct: (
        f"median {float(np.median(v)) - pct:+.1%}, min {min(v) - pct:+.1%}, max {max(v) - pct:+.1%}" if pct
        else f"median {float(np.median(v)):.0%}, min {min(v):.0%}, max {max(v):.0%}")
    return [f"{ours} at least {whom} (mean, within one std) at {len(table) - len(lost)} of {len(table)} points"
            + (f"; not at: {', '.join(lost)}" if lost else ""),
            f"{ours} over the best other policy: throughput {spread(ratio('throughput_tok_s'), 1)}; decode step "
            f"{spread(ratio('decode_latency_s'), 1)}",
            f"gap to the bound closed by {ours}: {spread([gap_closed(runs, ours)[0] for runs in table.values()], 0)}"]


def equal_concurrency_lines(rows: list[dict[str, Any]], systems: tuple[str, ...]) -> list[str]:
    """The report's "At equal concurrency" section: Horizon against every policy serving as many sequences a step
    (batch x batches in flight), throughput and decode step; empty where no point has such pairs."""
    # Horizon's own variants (Horizon-1 at 2b: the same plan as Horizon at b, bit for bit) are not "other policies"
    kept = {OURS, *rivals({r["system"] for r in rows}, OURS)}
    table = by_concurrency([r for r in rows if r["system"] in kept])
    if not any(OURS in runs for runs in table.values()):
        return []
    return ["## At equal concurrency", "",
            "Sequences served per decode step = batch x batches in flight: Horizon and Klotski at batch b (two in "
            "flight) beside the one-batch policies at 2b. Mean ± std over Horizon's seeds at the point; the bound is "
            "that of passes of that many sequences; step s = simulated seconds per decode step (each sequence's "
            "time per token).", "",
            "Throughput at equal concurrency (tok/s)", "", versus_table(table, OURS, systems), "",
            "Decode step at equal concurrency (seconds)", "", versus_table(table, OURS, systems, "decode_latency_s"),
            "",
            *versus_summary(table, OURS, "every other policy serving as many sequences"), ""]


def continuity_lines(rows: list[dict[str, Any]], systems: tuple[str, ...]) -> list[str]:
    """The report's "With the cache carried across passes" section (runs that have `continuity_bound_s`): how much the
    bound rises when a decode pass no longer starts from the best cache for its own routing, each policy's distance to
    it, and the gap Horizon closes at equal concurrency against it; empty without such runs."""
    return tighter_bound_lines(rows, systems, "continuity", "With the cache carried across passes",
                               "`continuity_bound`: still clairvoyant about the routing (an upper bound's knowledge), "
                               "but a decode pass starts from the cache the previous one left, not the best cache for "
                               "its own routing.")


def segment_lines(rows: list[dict[str, Any]], systems: tuple[str, ...]) -> list[str]:
    """The report's "With whole splits and slots per segment" section (runs that have `segment_bound_s`), as
    `continuity_lines` for `engine.sim.bounds.segment_bound`; empty without such runs."""
    return tighter_bound_lines(rows, systems, "segment", "With whole splits and slots per segment of layers",
                               "`segment_bound`: still clairvoyant about the routing, but each MoE layer's CPU/GPU "
                               "split is whole (not mixed across the pass by multipliers) and the slots are charged "
                               "per segment of consecutive layers, the most over every cut of each pass.")


def tighter_bound_lines(rows: list[dict[str, Any]], systems: tuple[str, ...], name: str, title: str,
                        what: str) -> list[str]:
    """A report section for a bound at least the per-pass one, recorded as `<name>_bound_s` / `above_<name>_bound`:
    how far it lies above the per-pass bound, each policy's distance to it, the gap Horizon closes at equal
    concurrency against it; empty without such runs."""
    key, above = f"{name}_bound_s", f"above_{name}_bound"
    rows = [r for r in rows if "error" not in r and r.get(key)]
    if not rows:
        return []
    rise = np.array([r[key] / r["lower_bound_s"] - 1 for r in rows])
    tight = [{**r, "above_lower_bound": r[above], "bound_tok_s": r["bound_tok_s"] * r["lower_bound_s"] / r[key]}
             for r in rows]
    table = by_concurrency([r for r in tight if r["system"] in {OURS, *rivals({r["system"] for r in tight}, OURS)}])
    return [f"## {title}", "",
            f"{what} Over {len(rows)} runs it lies {100 * float(np.median(rise)):.2f} % above the per-pass bound at "
            f"the median (max {100 * float(rise.max()):.2f} %; tighter at {int((rise > 0).sum())} runs).", "",
            f"above the {name} bound per policy (every run, its own passes)", "",
            bound_distribution(tight, systems), "",
            *versus_summary(table, OURS, f"every other policy serving as many sequences (against the {name} "
                                         "bound)")[2:], ""]


def single_batch_lines(rows: list[dict[str, Any]], ours: str = SINGLE) -> list[str]:
    """The report's "One batch in flight" section: `ours` (Horizon-1) against every one-batch policy at every point
    it ran, on its own seeds, against the bound of one-batch passes; empty without its runs."""
    table = {p: {s: [{**r, "point_bound_tok_s": r["bound_tok_s"]} for r in rs] for s, rs in runs.items()
                 if s == ours or all(int(r.get("in_flight") or 1) == 1 for r in rs)}
             for p, runs in by_point(rows).items() if ours in runs}
    table = {p: runs for p, runs in table.items() if len(runs) > 1}
    if not table:
        return []
    systems = (ours, *(s for s in SYSTEMS if any(s in runs for runs in table.values())))
    return [f"## One batch in flight: {ours} against every one-batch policy", "",
            f"Each point on {ours}'s seeds there; the bound is that of one batch's passes.", "",
            f"Throughput, {ours} against every one-batch policy (tok/s)", "", versus_table(table, ours, systems), "",
            f"Decode step, {ours} against every one-batch policy (seconds)", "",
            versus_table(table, ours, systems, "decode_latency_s"), "",
            *versus_summary(table, ours, "every one-batch policy"), ""]


def figure(rows: list[dict[str, Any]], path: Path) -> None:
    """Left: each policy's throughput over the point's bound (mean over seeds) at every point; right: the
    distribution of above_lower_bound per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = by_point(rows)
    points = list(table)
    systems = [s for s in SYSTEMS if any(s in runs for runs in table.values())]
    fig, (left, right) = plt.subplots(1, 2, figsize=(16, 5), gridspec_kw={"width_ratios": [3, 1]})
    for s in systems:
        y = [np.mean([r["throughput_tok_s"] / r["point_bound_tok_s"] for r in table[p][s]]) if s in table[p] else np.nan
             for p in points]
        left.plot(range(len(points)), y, "o-" if s == OURS else ".", lw=1.5 if s == OURS else 0.5, ms=5, label=s)
    left.set_xticks(range(len(points)), points, rotation=90, fontsize=5)
    left.set_ylabel("throughput / bound (≤ 2 batches in flight)")
    left.axhline(1.0, color="k", lw=0.5)
    left.legend(fontsize=7, ncol=4)
    data = [[100 * r["above_lower_bound"] for r in rows if r["system"] == s and "error" not in r] for s in systems]
    right.boxplot(data, showfliers=False)
    right.set_xticks(range(1, len(systems) + 1), systems, rotation=60, fontsize=7)
    right.set_ylabel("above the lower bound of its own passes (%)")
    fig.suptitle("Offload policies at every study point (transition-table forecasts, mean over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path, rows: list[dict[str, Any]], wall: float, launcher: str) -> Path:
    """report.md (points x policies, the bound distribution, the summary) and horizon_study.png of the study's
    rows (its jobs' `study_rows`) into `out`."""
    rows, replaced = newest_runs(rows)
    rows = sorted(rows, key=point_order)
    systems = tuple(s for s in SYSTEMS if any(r["system"] == s for r in rows)) + tuple(
        dict.fromkeys(r["system"] for r in rows if r["system"] not in SYSTEMS))
    points = list(dict.fromkeys(r["point"] for r in rows))
    seeds = sorted({r["seed"] for r in rows})
    out.mkdir(parents=True, exist_ok=True)
    figure(rows, out / "horizon_study.png")
    text = ["# Offload policies at every point, against the lower bound", "",
            f"{len(rows)} runs over {len(points)} points x seeds {seeds} in {wall:.0f} s wall under {launcher}; "
            "throughput tokens/s, mean ± std over seeds; where a (point, seed, system) ran more than once the newest "
            f"run's row wins ({replaced} older {'row' if replaced == 1 else 'rows'} replaced).", "", point_table(rows, systems), "",
            "above_lower_bound per policy (every run, its own passes' bound)", "", bound_distribution(rows, systems), "",
            *summary_lines(rows), "", "![study](horizon_study.png)", "", *equal_concurrency_lines(rows, systems),
            *single_batch_lines(rows), *continuity_lines(rows, systems),
            *segment_lines(rows, systems)]
    path = out / "report.md"
    path.write_text("\n".join(text))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--models", default=",".join(MODELS), help="the sweep set's models")
    ap.add_argument("--batches", default=",".join(map(str, sorted(BATCHES, reverse=True))),
                    help="the sweep and replay sets' batches")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--forecasts", default="transition", help="transition | stats | measured (oracle: upper bound)")
    ap.add_argument("--workers", type=int, default=2, help="parallel jobs (hydra.launcher.n_jobs)")
    ap.add_argument("--out", default="runs/bench/horizon_study", help="the folder of the sets' multiruns (resumed)")
    ap.add_argument("--fresh", action="store_true", help="rerun every job, even those complete in --out")
    ap.add_argument("--set", action="append", default=[], help="extra engine.simulate override (repeatable)")
    args = ap.parse_args()
    from engine.bench.bench_simulate_sweep import multirun
    from engine.report import build

    out = Path(args.out).resolve()
    common = [f"seed={args.seeds}", f"study.systems=[{args.systems}]", f"study.forecasts={args.forecasts}", *args.set]
    per_set = {"sweep": [f"model={args.models}", f"batch_size={args.batches}"],
               "regimes": [], "replay": [f"batch_size={args.batches}"]}
    wall = 0.0
    for name in args.sets.split(","):
        if name not in EXPERIMENTS:
            raise SystemExit(f"--sets: {name!r} is no set of this study; known: {', '.join(SETS)}")
        wall += multirun(EXPERIMENTS[name], out / name, args.workers, [*common, *per_set[name]], args.fresh)
    path = build(out)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(path.read_text())
    print(f"wall {wall:.1f} s with {args.workers} joblib worker(s) (Hydra starts included); 1-min load average at "
          f"the end {load:.2f}; report in {out}")


if __name__ == "__main__":
    main()
