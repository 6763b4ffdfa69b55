"""Study: in which regime MoEless beats EPLB (and Megatron-LM), one knob at a time.

The study is the multirun `python -m engine.serve -m +experiment=serverless_regimes` (one engine.serve simulation
per regime and seed; any Hydra launcher, resumable); its report `python -m engine.report <folder>`. This script runs
it under joblib into `--out` (a rerun resumes; `--fresh` starts over), times it and prints the report:

    python engine/bench/bench_serverless_regimes.py [--axes skew,variation,memory,hit_rate,copy_speed,distance,copy_speed_varied]
        [--model mixtral_8x7b] [--seeds 0] [--duration-s 20] [--workers 2] [--out runs/bench/serverless_regimes]

Every regime is an `engine.serve` simulation (Megatron-LM, EPLB and MoEless; the serve defaults otherwise) with
one knob moved from the default (`study.regime=<axis>_<value>`, e.g. `skew_0.6`; `default` moves none):

- `skew`: the synthetic routing's shared expert-popularity spread (`popularity_sigma` of every layer
  group; 0.2 is the default fitted to Mixtral-8x7B, larger is more skewed load);
- `variation`: how much each request's domain moves its experts' popularity (`domain_sigma`; the load's
  variation over time, which MoEless's per-iteration scaling is built for; 0 = one domain);
- `memory`: replica slots per device for both MoEless (`capacity_slots`) and EPLB (`num_redundant` = slots
  x G - E), the two at the same expert memory;
- `hit_rate`: the oracle forecasts' hit rate at d = 1 (an UPPER BOUND: the replayed routing degraded to an
  assumed accuracy, not a trained predictor);
- `copy_speed`: peer and host copy bandwidth x f (`hardware.interconnect.pair_gbps`,
  `hardware.host_link.peak_gbps` of the job's machine): the cost of a weight copy in layer times, which decides
  whether re-placing replicas every iteration can pay; `copy_speed_varied` the same at `domain_sigma` 2;
- `distance`: MoEless's prediction distance d (its copies start d layers ahead; the oracle's hit rate
  decays x0.95 per extra layer).

The report (report.md, points.json, regimes.png): one row per point, MoEless's latency with and without copy
waits against EPLB and Megatron-LM; one expert's peer copy in MoE-layer times and in layer-block times, the block
being the attention part T_misc plus the MoE part, Megatron-LM's means.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.bench.bench_serverless_seeds import mean_std, pct  # noqa: E402

GROUPS = ("input", "middle", "output")  # the synthetic routing's layer groups (engine/synthetic_routing.py)

# axis -> (what the value is, its values); the first value of each axis but `copy_speed_varied` is the default
# configuration (the `default` regime, run once per seed and shared out to every axis by `with_defaults`)
AXES: dict[str, tuple[str, tuple[float, ...]]] = {
    "skew": ("popularity_sigma", (0.2, 0.6, 1.2)),
    "variation": ("domain_sigma", (1.0, 0.0, 2.0)),
    "memory": ("slots per device (MoEless = EPLB)", (2, 3, 4)),
    "hit_rate": ("oracle hit rate at d = 1 (UPPER BOUND)", (0.9, 0.5, 0.7, 1.0)),
    "copy_speed": ("copy bandwidth x", (1, 10, 30, 50, 70, 100, 1000)),
    "copy_speed_varied": ("copy bandwidth x (domain_sigma 2)", (1, 30, 50, 70, 100, 1000)),
    "distance": ("prediction distance d", (1, 2, 4)),
}
NOT_DEFAULT_FIRST = ("copy_speed_varied",)
DEFAULT = "default"


def regimes(axes: Optional[list[str]] = None) -> dict[str, tuple[str, float]]:
    """Every regime's name (`study.regime`) -> (axis, value), in the study's order: `default` first, then each
    axis's points but the default one."""
    out: dict[str, tuple[str, float]] = {DEFAULT: (DEFAULT, 0.0)}
    for axis in axes or list(AXES):
        if axis not in AXES:
            raise ValueError(f"--axes: {axis!r} is no serverless regime axis; known: {', '.join(AXES)}")
        values = AXES[axis][1] if axis in NOT_DEFAULT_FIRST else AXES[axis][1][1:]
        out.update({f"{axis}_{v:g}": (axis, float(v)) for v in values})
    return out


def regime_named(name: str) -> tuple[str, float]:
    """(axis, value) of a regime's name (one line naming the known ones when it is none of them)."""
    known = regimes()
    if name not in known:
        raise ValueError(f"study.regime: {name!r} is not a serverless regime; known: {', '.join(known)}")
    return known[name]


def regime_settings(name: str, node: Any) -> dict[str, Any]:
    """The `engine.serve` keys a regime sets (dotted key -> value) on the composed config `node`: the copy links
    scale the job's own machine's, the memory axis sizes EPLB from the job's model and devices."""
    axis, value = regime_named(name)

    def routing(knob: str, v: float) -> dict[str, Any]:
        return {f"routing.synthetic.{g}.{knob}": float(v) for g in GROUPS}

    def copies(f: float) -> dict[str, Any]:
        hw = node.hardware
        return {"hardware.interconnect.pair_gbps": float(hw.interconnect.pair_gbps) * f,
                "hardware.host_link.peak_gbps": float(hw.host_link.peak_gbps) * f}

    if axis == "skew":
        return routing("popularity_sigma", value)
    if axis == "variation":
        return routing("domain_sigma", value)
    if axis == "memory":
        from models.loading import resolve_model_config  # why lazy: only this axis needs the model's experts

        experts = resolve_model_config(node.model).num_experts
        devices = int(node.serverless.num_devices or node.hardware.num_devices)
        return {"serverless.policies.moeless.capacity_slots": int(value),
                "serverless.policies.eplb.num_redundant": int(value) * devices - experts}
    if axis == "hit_rate":
        return {"predictor.oracle.hit_rate": value}
    if axis == "copy_speed":
        return copies(value)
    if axis == "copy_speed_varied":
        return {**copies(value), **routing("domain_sigma", 2.0)}
    if axis == "distance":
        return {"predictor.distance": int(value)}
    return {}  # the default configuration


def with_defaults(rows: list[dict[str, Any]], axes: list[str]) -> list[dict[str, Any]]:
    """The rows with the default configuration's run entered as each axis's first point."""
    defaults = [r for r in rows if r["axis"] == "default"]
    out = []
    for axis in axes:
        if axis not in NOT_DEFAULT_FIRST:
            out += [{**r, "axis": axis, "value": float(AXES[axis][1][0])} for r in defaults]
        out += [r for r in rows if r["axis"] == axis]
    return out


def point_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One point over its seeds: MoEless vs EPLB / Megatron-LM (latency with and without copy waits, as
    MoEless / other - 1) and one expert's peer copy in MoE-layer times (Megatron-LM's mean layer)."""
    def rel(metric: str, other: str) -> tuple[float, float]:
        return mean_std([r["systems"]["moeless"][metric] / r["systems"][other][metric] - 1 for r in rows])

    return {"axis": rows[0]["axis"], "value": rows[0]["value"], "seeds": [r["seed"] for r in rows],
            "moeless_ms": mean_std([r["systems"]["moeless"]["latency_ms"] for r in rows]),
            "moeless_exec_ms": mean_std([r["systems"]["moeless"]["exec_ms"] for r in rows]),
            "eplb_ms": mean_std([r["systems"]["eplb"]["latency_ms"] for r in rows]),
            "megatron_ms": mean_std([r["systems"]["static_ep"]["latency_ms"] for r in rows]),
            "vs_eplb": rel("latency_ms", "eplb"), "vs_eplb_exec": rel("exec_ms", "eplb"),
            "vs_megatron": rel("latency_ms", "static_ep"), "vs_megatron_exec": rel("exec_ms", "static_ep"),
            "warm_start_rate": mean_std([r["systems"]["moeless"]["warm_start_rate"] for r in rows]),
            "copy_layer_times": mean_std([r["cost_model"]["peer_copy_ms"] / r["systems"]["static_ep"]["latency_ms"]
                                          for r in rows]),
            # a copy issued a layer ahead overlaps that layer's attention block and its MoE part
            "copy_block_times": mean_std([r["cost_model"]["peer_copy_ms"] / (r["systems"]["static_ep"]["latency_ms"]
                                                                              + r["systems"]["static_ep"]["misc_ms"])
                                          for r in rows]),
            "eplb_rearrangements_per_layer": float(np.mean([r["eplb_rearrangements_per_layer"] for r in rows]))}


def points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows grouped by (axis, value), in the order they were asked for."""
    keys = list(dict.fromkeys((r["axis"], r["value"]) for r in rows))
    return [point_stats([r for r in rows if (r["axis"], r["value"]) == key]) for key in keys]


def markdown(pts: list[dict[str, Any]]) -> str:
    num = lambda ms: f"{ms[0]:.4g}" + (f" ± {ms[1]:.2g}" if ms[1] else "")
    lines = ["| axis | value | copy / MoE layer | copy / layer block | MoEless ms (waits incl.) | without waits | EPLB ms "
             "| Megatron-LM ms | MoEless vs EPLB | vs EPLB, no waits | vs Megatron-LM | vs Megatron-LM, no waits "
             "| warm starts |", "| --- |" + " --- |" * 12]
    for p in pts:
        lines.append(f"| {p['axis']} | {p['value']:g} | {p['copy_layer_times'][0]:.3g} | {p['copy_block_times'][0]:.3g} "
                     f"| {num(p['moeless_ms'])} "
                     f"| {num(p['moeless_exec_ms'])} | {num(p['eplb_ms'])} | {num(p['megatron_ms'])} | {pct(*p['vs_eplb'])} "
                     f"| {pct(*p['vs_eplb_exec'])} | {pct(*p['vs_megatron'])} | {pct(*p['vs_megatron_exec'])} "
                     f"| {p['warm_start_rate'][0]:.2f} |")
    return "\n".join(lines)


def figure(pts: list[dict[str, Any]], path: Path) -> None:
    """One panel per axis: MoEless's latency / EPLB's (copy waits incl. and without), 1 = parity."""
    import matplotlib  # why lazy: only the figure needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = list(dict.fromkeys(p["axis"] for p in pts))
    cols = min(4, len(axes))
    rows = -(-len(axes) // cols)
    fig, panels = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
    for ax, axis in zip(panels.reshape(-1), axes):
        copies = axis.startswith("copy_speed")  # plotted against what a copy costs, in MoE-layer times
        x_of = (lambda p: p["copy_layer_times"][0]) if copies else (lambda p: p["value"])
        mine = sorted((p for p in pts if p["axis"] == axis), key=x_of)
        x = [x_of(p) for p in mine]
        for key, label, style in (("vs_eplb", "copy waits incl.", "o-"), ("vs_eplb_exec", "without copy waits", "s--")):
            ax.errorbar(x, [1 + p[key][0] for p in mine], yerr=[p[key][1] for p in mine], fmt=style, label=label,
                        capsize=3)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")
        if copies:
            ax.set_xscale("log")
        ax.set_title(axis, fontsize=9)
        ax.set_xlabel("one expert copy / Megatron-LM MoE-layer time" if copies else AXES[axis][0], fontsize=8)
        ax.set_ylabel("MoEless / EPLB latency", fontsize=8)
    for ax in panels.reshape(-1)[len(axes):]:
        ax.axis("off")
    panels[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(out: Path, rows: list[dict[str, Any]], wall: float, launcher: str) -> Path:
    """report.md (the points table), points.json and regimes.png of a multirun's rows (engine.report's
    `serve_row`s of the study's jobs, tagged with their regime's axis and value) into `out`."""
    import json

    order = list(regimes())
    rows = sorted(rows, key=lambda r: (order.index(r["regime"]) if r.get("regime") in order else len(order), r["seed"]))
    axes = [a for a in AXES if any(r["axis"] == a for r in rows)]
    pts = points(with_defaults(rows, axes))
    out.mkdir(parents=True, exist_ok=True)
    text = ["# MoEless vs EPLB and Megatron-LM, one knob at a time", "",
            f"{len(rows)} engine.serve runs (seeds {sorted({r['seed'] for r in rows})}) in {wall:.0f} s wall under "
            f"{launcher}; relative changes MoEless / other - 1 per seed, then mean ± std.", "", markdown(pts), "",
            "![regimes](regimes.png)", ""]
    (out / "points.json").write_text(json.dumps({"wall_s": wall, "points": pts}, indent=1))
    figure(pts, out / "regimes.png")
    path = out / "report.md"
    path.write_text("\n".join(text))
    return path


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--axes", default=",".join(AXES))
    ap.add_argument("--model", default="mixtral_8x7b")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=2, help="parallel jobs (hydra.launcher.n_jobs)")
    ap.add_argument("--out", default="runs/bench/serverless_regimes", help="the multirun folder (a rerun resumes it)")
    ap.add_argument("--fresh", action="store_true", help="rerun every job, even those complete in --out")
    ap.add_argument("--set", action="append", default=[], help="extra engine.serve override (repeatable)")
    args = ap.parse_args(argv)
    from engine.bench.bench_simulate_sweep import multirun  # why lazy: the simulator's configs, for the timer only

    names = ",".join(regimes(args.axes.split(",")))
    out = Path(args.out).resolve()
    wall = multirun("serverless_regimes", out, args.workers, [f"study.regime={names}", f"seed={args.seeds}",
                                                             f"model={args.model}",
                                                             f"workload.azure.duration_s={args.duration_s:g}",
                                                             *args.set], args.fresh, entry="engine.serve")
    from engine.report import build  # the study's report, by engine.report

    path = build(out)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(path.read_text())
    print(f"wall {wall:.1f} s with {args.workers} joblib worker(s) (Hydra start included); 1-min load average at the "
          f"end {load:.2f}; report in {out}")


if __name__ == "__main__":
    main()
