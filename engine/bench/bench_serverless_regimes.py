"""Benchmark: in which regime MoEless beats EPLB (and Megatron-LM), one knob at a time.

    python engine/bench/bench_serverless_regimes.py [--axes skew,variation,memory,hit_rate,copy_speed,distance,copy_speed_varied]
        [--model mixtral_8x7b] [--seeds 0] [--duration-s 20] [--workers 2] [--out runs/bench/serverless_regimes]

Every point is an in-process `engine.serve` simulation (Megatron-LM, EPLB and MoEless; the serve defaults
otherwise) with one knob moved from the default:

- `skew`: the synthetic routing's shared expert-popularity spread (`popularity_sigma` of every layer
  group; 0.2 is the default fitted to Mixtral-8x7B, larger is more skewed load);
- `variation`: how much each request's domain moves its experts' popularity (`domain_sigma`; the load's
  variation over time, which MoEless's per-iteration scaling is built for; 0 = one domain);
- `memory`: replica slots per device for both MoEless (`capacity_slots`) and EPLB (`num_redundant` = slots
  x G - E), the two at the same expert memory;
- `hit_rate`: the oracle forecasts' hit rate at d = 1 (an UPPER BOUND: the replayed routing degraded to an
  assumed accuracy, not a trained predictor);
- `copy_speed`: peer and host copy bandwidth x f (`hardware.interconnect.pair_gbps`,
  `hardware.host_link.peak_gbps`): the cost of a weight copy in layer times, which decides whether
  re-placing replicas every iteration can pay; `copy_speed_varied` the same at `domain_sigma` 2;
- `distance`: MoEless's prediction distance d (its copies start d layers ahead; the oracle's hit rate
  decays x0.95 per extra layer).

Writes regimes.md (one row per point: MoEless's latency with and without copy waits against EPLB and
Megatron-LM; one expert's peer copy in MoE-layer times and in layer-block times, the block being the
attention part T_misc plus the MoE part, Megatron-LM's means), rows.jsonl and regimes.png into `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conf import compose  # noqa: E402
from models.loading import resolve_model_config  # noqa: E402
from schedulers.hardware import load_hardware  # noqa: E402
from engine.bench.bench_serverless_seeds import mean_std, pct, serve_overrides, study_args, study_rows, study_wall  # noqa: E402

SYSTEMS = "systems=[static_ep,eplb,moeless]"
GROUPS = ("input", "middle", "output")  # the synthetic routing's layer groups (engine/synthetic_routing.py)
SERVED_ON = load_hardware("a6000")  # engine.serve's default hardware (conf/serve.yaml), whose copy links the axis scales


def routing_knob(name: str, value: float) -> list[str]:
    return [f"routing.synthetic.{g}.{name}={value:g}" for g in GROUPS]


def copy_speed(f: float) -> list[str]:
    return [f"hardware.interconnect.pair_gbps={SERVED_ON.interconnect.pair_gbps * f:g}",
            f"hardware.host_link.peak_gbps={SERVED_ON.host_link.peak_gbps * f:g}"]


def memory(slots: int, model: str) -> list[str]:
    """MoEless and EPLB both holding `slots` replicas per device of `model` on engine.serve's default devices."""
    experts = resolve_model_config(compose("serve", [f"model={model}"]).model).num_experts
    return [f"serverless.policies.moeless.capacity_slots={slots}",
            f"serverless.policies.eplb.num_redundant={slots * SERVED_ON.num_devices - experts}"]


# axis -> (what the value is, [(value, overrides)]); the first value of each axis but `copy_speed_varied` is
# the default configuration
AXES: dict[str, tuple[str, list[tuple[float, list[str]]]]] = {
    "skew": ("popularity_sigma", [(v, routing_knob("popularity_sigma", v)) for v in (0.2, 0.6, 1.2)]),
    "variation": ("domain_sigma", [(v, routing_knob("domain_sigma", v)) for v in (1.0, 0.0, 2.0)]),
    "memory": ("slots per device (MoEless = EPLB)", [(s, []) for s in (2, 3, 4)]),  # overrides: `memory`, per model
    "hit_rate": ("oracle hit rate at d = 1 (UPPER BOUND)", [(h, [f"predictor.oracle.hit_rate={h:g}"])
                                                            for h in (0.9, 0.5, 0.7, 1.0)]),
    "copy_speed": ("copy bandwidth x", [(f, copy_speed(f)) for f in (1, 10, 30, 50, 70, 100, 1000)]),
    "copy_speed_varied": ("copy bandwidth x (domain_sigma 2)",
                          [(f, copy_speed(f) + routing_knob("domain_sigma", 2.0)) for f in (1, 30, 50, 70, 100, 1000)]),
    "distance": ("prediction distance d", [(d, [f"predictor.distance={d}"]) for d in (1, 2, 4)]),
}
NOT_DEFAULT_FIRST = ("copy_speed_varied",)


def regime_jobs(axes: list[str], model: str, seeds: list[int], duration_s: float, out: Optional[Path],
                extra_all: tuple[str, ...] = ()) -> list[tuple[list[str], Optional[str], dict[str, Any]]]:
    """One job per (point, seed); the default configuration (every axis's first value but
    `copy_speed_varied`'s) once per seed, tagged axis "default" (`with_defaults` shares it out)."""
    jobs = []
    for seed in seeds:
        folder = str(out / "runs" / f"default_seed{seed}") if out else None
        jobs.append((serve_overrides(model, seed, duration_s, [SYSTEMS, *extra_all]), folder,
                     {"axis": "default", "value": 0.0, "seed": seed}))
    for axis in axes:
        values = AXES[axis][1] if axis in NOT_DEFAULT_FIRST else AXES[axis][1][1:]
        for value, extra in values:
            extra = memory(int(value), model) if axis == "memory" else extra
            for seed in seeds:
                tags = {"axis": axis, "value": value, "seed": seed}
                folder = str(out / "runs" / f"{axis}_{value:g}_seed{seed}") if out else None
                jobs.append((serve_overrides(model, seed, duration_s, [SYSTEMS, *extra_all, *extra]), folder, tags))
    return jobs


def with_defaults(rows: list[dict[str, Any]], axes: list[str]) -> list[dict[str, Any]]:
    """The rows with the default configuration's run entered as each axis's first point."""
    defaults = [r for r in rows if r["axis"] == "default"]
    out = []
    for axis in axes:
        if axis not in NOT_DEFAULT_FIRST:
            out += [{**r, "axis": axis, "value": AXES[axis][1][0][0]} for r in defaults]
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


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--axes", default=",".join(AXES))
    ap.add_argument("--model", default="mixtral_8x7b")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--duration-s", type=float, default=20.0)
    study_args(ap, "runs/bench/serverless_regimes")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = study_rows(args, lambda: regime_jobs(args.axes.split(","), args.model, [int(s) for s in args.seeds.split(",")],
                                                args.duration_s, out, tuple(args.set)))
    axes = [a for a in args.axes.split(",") if any(r["axis"] == a for r in rows)]  # the ones that were run
    pts = points(with_defaults(rows, axes))
    wall = study_wall(args, t0, "points.json")
    text = markdown(pts)
    (out / "regimes.md").write_text(text + f"\n\nwall time {wall:.0f} s ({args.workers} workers)\n")
    (out / "points.json").write_text(json.dumps({"args": vars(args), "wall_s": wall, "points": pts}, indent=1))
    figure(pts, out / "regimes.png")
    print(text)
    print(f"wall time {wall:.0f} s -> {out}")
    return pts


if __name__ == "__main__":
    main()
