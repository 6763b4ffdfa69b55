"""Benchmark: in which cost regime PreSched's cross-layer scheduling matters. LayerScope's ablation (§5.3,
Fig. 13: Mixtral-8x7B, A100, batch 64, 54.1 % of the throughput lost without PreSched) re-run while one cost
of the calibrated model moves at a time, mean ± std over routing seeds.

"Without PreSched" is `scheduler=layerwise` (the greedy per-layer split of eq. 1 and two next-layer prefetches,
LayerScope's cache and predictor), in two flavours: as the shared mechanism runs it (a prefetch not started by the
next plan point is dropped) and with `keep_queued_prefetches=true` (it is not: it keeps the head of the link and
the next layer's on-demand loads wait behind it, HybriMoE's `wait_prefetch`). The lead is PreSched's
1 - throughput(layerwise) / throughput(presched) on the same routing, per seed; its ceiling, what any schedule
could gain over layerwise in the simulator's machine model, is 1 - lower bound / layerwise's time
(`engine.sim.bounds.lower_bound`: any split, any transfers, any cache policy). Every regime runs with the
transition-table predictor (real, fitted on held-out routing) and with the default oracle (LLaPor's measured hit
rate: an upper bound); the prediction axis runs the oracle at a flat hit rate.

Axes (each from the calibrated point, `conf/hardware/a100_pcie4.yaml`): the per-expert call overhead
(`expert_dispatch_us`: `gpu.kernel_overhead_us` = `cpu.expert_overhead_us`), the link bandwidth
(`host_link.peak_gbps`), the CPU GEMM efficiency (`cpu.matmul_efficiency`), the batch, the expert cache (a
fraction of the model's experts instead of the memory plan's), the forecasts' hit rate, and a few
combinations of the regimes that favour cross-layer scheduling. For scale, the calibrated point also runs systems
that lose more than cross-layer scheduling (Fiddler: every missing expert on the CPU; Fate and on-demand: every
expert on the GPU; kTransformers: a static placement), each against PreSched the same way.

The study is the multirun `python -m engine.simulate -m +experiment=presched_regimes` (one job per regime and
seed, `engine.studies`; its report `python -m engine.report <folder>`); this script runs it under joblib into
`--out` (a rerun resumes; `--fresh` starts over), times it and prints the report:

    python engine/bench/bench_presched_regimes.py [--seeds 0,1,2,3,4] [--workers 2] [--out runs/bench/presched_regimes]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from engine.bench.bench_simulate_sweep import hardware, multirun, scheduler_settings, sweep_predictor  # noqa: E402
from conf import compose  # noqa: E402
from engine.calibrate_paper import load_points  # noqa: E402
from engine.report import PUBLISHED  # noqa: E402
from engine.sim.bounds import lower_bound  # noqa: E402
from engine.sim.run import PreparedRouting, RunSpec, prepare_routing, simulate  # noqa: E402
from models.loading import resolve_model_config  # noqa: E402
from schedulers.hardware import HardwareProfile  # noqa: E402

# the ablation's point and figure, as engine.calibrate_paper evaluates them
ABLATION = next(p for p in load_points(PUBLISHED) if p.id == "abl_presched_mixtral_a100_b64")
MODEL, MACHINE, BATCH, PAPER_LOSS = ABLATION.model, ABLATION.hardware, ABLATION.batch, ABLATION.value
SYSTEMS = {"presched": ("presched", False), "layerwise": ("layerwise", False), "layerwise_kept": ("layerwise", True)}
BASELINES = ("layerwise", "layerwise_kept")  # "LayerScope w/o PreSched", as the mechanism runs it / prefetches kept
REFERENCES = ("fiddler", "fate", "ondemand", "ktransformers")
FORECASTS = ("transition", "measured")  # sweep_predictor points: the real routing-only predictor, the default oracle


@dataclass(frozen=True)
class Regime:
    """One point of the sweep: the calibrated A100 machine and the ablation's batch, with some costs changed."""

    axis: str
    setting: str
    dispatch_us: Optional[float] = None  # per expert call, GPU and CPU (None: the calibrated 1,106 us)
    link_scale: float = 1.0  # x host_link.peak_gbps
    cpu_scale: float = 1.0  # x cpu.matmul_efficiency
    batch: int = BATCH
    cache_fraction: Optional[float] = None  # expert-cache slots / the model's experts (None: the memory plan's)
    forecasts: tuple[str, ...] = FORECASTS
    references: tuple[str, ...] = ()  # other systems (conf/scheduler/<name>.yaml) run for scale

    @property
    def name(self) -> str:
        """The regime's name in a study multirun (`study.regime=<name>`, conf/experiment/presched_regimes.yaml)."""
        if self.axis == "calibrated":
            return "calibrated"
        return re.sub(r"[^a-z0-9]+", "_", f"{self.axis} {self.setting}".lower().replace("%", "pct")).strip("_")


REGIMES = [
    Regime("calibrated", "as fitted (1,106 us/call, PCIe 4.0, b64)", references=REFERENCES),
    *(Regime("expert call overhead", f"{us:g} us", dispatch_us=us) for us in (0.0, 100.0, 300.0)),
    *(Regime("link bandwidth", f"x{s:g}", link_scale=s) for s in (0.25, 0.5, 2.0)),
    *(Regime("CPU efficiency", f"x{s:g}", cpu_scale=s) for s in (0.5, 2.0)),
    *(Regime("batch", f"{b}", batch=b) for b in (4, 8, 16)),
    *(Regime("expert cache", f"{f:.0%} of experts", cache_fraction=f) for f in (0.1, 0.4, 0.6)),
    *(Regime("forecasts", f"oracle hit {h}", forecasts=(h,)) for h in ("0.5", "1.0")),
    Regime("combined", "0 us, link x0.5, cache 10%", dispatch_us=0.0, link_scale=0.5, cache_fraction=0.1),
    Regime("combined", "link x0.25, CPU x2", link_scale=0.25, cpu_scale=2.0),
    Regime("combined", "0 us, b4", dispatch_us=0.0, batch=4),
    Regime("combined", "link x0.5, b8", link_scale=0.5, batch=8),
    Regime("combined", "link x0.25, b16", link_scale=0.25, batch=16),
    Regime("combined", "link x0.5, b4", link_scale=0.5, batch=4),
]


def regime_named(name: str) -> Regime:
    """The regime of a study job's `study.regime` (one line naming the known ones when it is none of them)."""
    found = next((r for r in REGIMES if r.name == name), None)
    if found is None:
        raise ValueError(f"study.regime: {name!r} is not a PreSched regime; known: {', '.join(r.name for r in REGIMES)}")
    return found


def profile(regime: Regime) -> HardwareProfile:
    """The calibrated machine with the regime's costs."""
    hw = hardware(MACHINE)
    gpu, cpu, link = hw.gpu, hw.cpu, hw.host_link
    if regime.dispatch_us is not None:
        gpu = replace(gpu, kernel_overhead_us=float(regime.dispatch_us))
        cpu = replace(cpu, expert_overhead_us=float(regime.dispatch_us))
    cpu = replace(cpu, matmul_efficiency=cpu.matmul_efficiency * regime.cpu_scale)
    link = replace(link, peak_gbps=link.peak_gbps * regime.link_scale)
    return replace(hw, gpu=gpu, cpu=cpu, host_link=link)


@lru_cache(maxsize=None)
def model() -> tuple[Any, str]:
    """The resolved `conf/model/<MODEL>.yaml` and the name runs report (cached per worker process)."""
    node = compose("simulate", [f"model={MODEL}"]).model
    return resolve_model_config(node), str(node.name)


@lru_cache(maxsize=8)
def routing(batch: int, seed: int) -> PreparedRouting:
    """One (batch, seed) routing, replayed by every regime and system (cached per worker process)."""
    return prepare_routing(base_spec(batch, seed))


def base_spec(batch: int, seed: int) -> RunSpec:
    cfg, name = model()
    return RunSpec(model=cfg, model_name=name, hardware=hardware(MACHINE), scheduler=scheduler_settings("presched"),
                   batch_size=batch, prompt_len=512, gen_len=64, seed=seed)


def run_regime(args: tuple) -> list[dict[str, Any]]:
    """Every system with every forecast of one regime on one seed's routing: args (regime, seed) or (regime, seed,
    expert_format), the experts' `model.expert_format` (bf16 when absent; the routing does not depend on it)."""
    regime, seed = args[:2]
    prepared = routing(regime.batch, seed)
    spec = replace(base_spec(regime.batch, seed), hardware=profile(regime),
                   expert_format=args[2] if len(args) > 2 else "bf16")
    if regime.cache_fraction is not None:
        experts = spec.model.num_experts * len(spec.model.moe_layers)
        spec = replace(spec, cache_slots=int(round(regime.cache_fraction * experts)))
    rows, bound = [], None
    for point in regime.forecasts:
        for system, (name, kept) in {**SYSTEMS, **{r: (r, False) for r in regime.references}}.items():
            settings = scheduler_settings(name)
            if kept:
                settings = replace(settings, keep_queued_prefetches=True)
            t0 = time.process_time()
            out = simulate(replace(spec, scheduler=settings, predictor=sweep_predictor(point)), prepared)
            if bound is None:  # the bound does not depend on the schedule
                capacity = out.memory.cache_slots + settings.staging_slots
                bound = lower_bound(spec.model, out.cost, prepared.passes, capacity)
            rows.append({"axis": regime.axis, "setting": regime.setting, "seed": seed, "forecasts": point,
                         "expert_format": spec.expert_format,
                         "system": system, "sim_cpu_s": time.process_time() - t0,
                         **{k: out.summary[k] for k in ("throughput_tok_s", "decode_latency_s", "cache_slots")},
                         "ceiling": 1 - bound / out.summary["total_s"], "t_io_s": out.cost.t_io,
                         "moe_layers": len(spec.model.moe_layers),
                         "hit_rate_d1": out.summary["predictor_hit_rate"],
                         "prefetch_hit_rate": out.summary["prefetch_hit_rate"]})
    return rows


# ---- report -------------------------------------------------------------------------------------------------------
def leads(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], list[float]]:
    """(axis, setting, forecasts, baseline) -> PreSched's lead per seed: 1 - throughput(baseline) / throughput(presched)
    on the same routing."""
    thr = {(r["axis"], r["setting"], r["forecasts"], r["system"], r["seed"]): r["throughput_tok_s"] for r in rows}
    out: dict[tuple[str, str, str, str], list[float]] = {}
    for (axis, setting, point, system, seed), value in sorted(thr.items(), key=lambda kv: kv[0][4]):
        if system != "presched":
            ours = thr[(axis, setting, point, "presched", seed)]
            out.setdefault((axis, setting, point, system), []).append(1 - value / ours)
    return out


def fmt(values: Optional[list[float]]) -> str:
    if not values:
        return "—"
    return f"{100 * np.mean(values):+.1f} % ± {100 * np.std(values):.1f}"


def forecast_label(point: str) -> str:
    return {"transition": "transition", "measured": "oracle, measured LLaPor (upper bound)"}.get(
        point, f"oracle at {point} (upper bound)")


def table(rows: list[dict[str, Any]]) -> str:
    lead = leads(rows)
    thr: dict[tuple, list[float]] = {}
    hits: dict[tuple, list[float]] = {}
    ceiling: dict[tuple, list[float]] = {}
    for r in rows:
        key = (r["axis"], r["setting"], r["forecasts"])
        if r["system"] == "presched":
            thr.setdefault(key, []).append(r["throughput_tok_s"])
            if np.isfinite(r["hit_rate_d1"]):
                hits.setdefault(key, []).append(r["hit_rate_d1"])
        else:
            ceiling.setdefault((*key, r["system"]), []).append(r["ceiling"])
    load = prefetch_load(rows)
    lines = ["| axis | setting | forecasts (hit rate d=1) | PreSched tok/s | prefetch load | "
             "lead over layerwise (ceiling) | lead, prefetches kept queued (ceiling) |", "|---" * 7 + "|"]
    for key in dict.fromkeys((r["axis"], r["setting"], r["forecasts"]) for r in rows):
        hit = hits.get(key)
        label = forecast_label(key[2]) + (f" ({np.mean(hit):.2f})" if hit else "")
        cells = [f"{fmt(lead.get((*key, system)))} (≤ {100 * np.mean(ceiling[(*key, system)]):.1f} %)"
                 for system in ("layerwise", "layerwise_kept")]
        lines.append(f"| {key[0]} | {key[1]} | {label} | {np.mean(thr[key]):.2f} | {load[key]:.2f} | {cells[0]} | "
                     f"{cells[1]} |")
    return "\n".join(lines)


def reference_table(rows: list[dict[str, Any]]) -> str:
    """For scale: what removing more than cross-layer scheduling costs at the calibrated point."""
    lead = leads(rows)
    refs = [key for key in lead if key[3] not in BASELINES]
    if not refs:
        return ""
    points = list(dict.fromkeys(key[2] for key in refs))
    lines = ["| system (calibrated point) | " + " | ".join(f"throughput lost vs PreSched, {forecast_label(p)}"
                                                        for p in points) + " |", "|---|" + "---|" * len(points)]
    for system in dict.fromkeys(key[3] for key in refs):
        cells = [fmt(next((v for key, v in lead.items() if key[2:] == (p, system)), None)) for p in points]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per axis: PreSched's lead per setting (transition / oracle forecasts x the two baseline flavours,
    mean ± std), the ceiling any schedule has over each baseline, and the paper's 54.1 %."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lead = leads(rows)
    axes = list(dict.fromkeys(r["axis"] for r in rows))
    cols = min(4, len(axes))
    rows_of_panels = (len(axes) + cols - 1) // cols
    fig, panels = plt.subplots(rows_of_panels, cols, figsize=(3.6 * cols, 3.4 * rows_of_panels + 1), sharey=True,
                               squeeze=False)
    slots = [(family, system) for family in ("transition", "oracle") for system in BASELINES]
    colours = {"transition": "tab:blue", "oracle": "tab:green"}
    width = 0.8 / len(slots)
    for panel, axis in zip(panels.flat, axes):
        settings = list(dict.fromkeys(r["setting"] for r in rows if r["axis"] == axis))
        for x, setting in enumerate(settings):
            for point in dict.fromkeys(r["forecasts"] for r in rows if (r["axis"], r["setting"]) == (axis, setting)):
                family = "transition" if point == "transition" else "oracle"
                for system in BASELINES:
                    values = lead.get((axis, setting, point, system))
                    if not values:
                        continue
                    x0 = x + (slots.index((family, system)) - (len(slots) - 1) / 2) * width
                    panel.bar(x0, 100 * np.mean(values), width, yerr=100 * np.std(values), color=colours[family],
                              hatch="//" if system == "layerwise_kept" else None, edgecolor="k", lw=0.3,
                              label=("transition predictor" if family == "transition" else "oracle (upper bound)")
                              + (", prefetches kept queued" if system == "layerwise_kept" else ""))
                    ceiling = [r["ceiling"] for r in rows if r["system"] == system
                               and (r["axis"], r["setting"], r["forecasts"]) == (axis, setting, point)]
                    panel.plot([x0 - width / 2, x0 + width / 2], [100 * np.mean(ceiling)] * 2, color="k", lw=1.5,
                               label="ceiling: any schedule over that baseline (lower bound)")
        panel.axhline(100 * PAPER_LOSS, color="tab:red", ls="--", lw=1, label=f"paper {100 * PAPER_LOSS:.1f} %")
        panel.axhline(0, color="k", lw=0.5)
        panel.set_xticks(np.arange(len(settings)), [s.replace(", ", ",\n").replace(" (", "\n(") for s in settings],
                         fontsize=7 if len(settings) < 5 else 6)
        panel.set_title(axis, fontsize=9)
    for panel in panels[:, 0]:
        panel.set_ylabel("throughput lost w/o PreSched (%)", fontsize=8)
    for panel in list(panels.flat)[len(axes):]:
        panel.axis("off")
    seen: dict[str, Any] = {}
    for panel in panels.flat:
        for handle, label in zip(*panel.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    fig.legend(list(seen.values()), list(seen.keys()), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"PreSched's lead over the greedy per-layer split by cost regime\n{MODEL}, {MACHINE} "
                 f"(mean ± std over seeds)", fontsize=10)
    fig.tight_layout(rect=(0, 0.09, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prefetch_load(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], float]:
    """(axis, setting, forecasts) -> the link time of the baseline's fixed prefetches per MoE layer over PreSched's
    decode time per MoE layer (mean over seeds): above 1 a link that cannot drop queued copies falls behind."""
    count = scheduler_settings("layerwise").prefetch_count
    out: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        if r["system"] == "presched":
            layer_s = r["decode_latency_s"] / r["moe_layers"]
            out.setdefault((r["axis"], r["setting"], r["forecasts"]), []).append(count * r["t_io_s"] / layer_s)
    return {key: float(np.mean(v)) for key, v in out.items()}


def backlog_figure(rows: list[dict[str, Any]], path: Path) -> None:
    """PreSched's lead over the kept-prefetch baseline against the baseline's prefetch load, every regime."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lead, load = leads(rows), prefetch_load(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, marker in zip(BASELINES, ("o", "s")):
        for family, colour in (("transition", "tab:blue"), ("oracle", "tab:green")):
            keys = [k for k in load if (k[2] == "transition") == (family == "transition") and (*k, system) in lead]
            ax.errorbar([load[k] for k in keys], [100 * np.mean(lead[(*k, system)]) for k in keys],
                        yerr=[100 * np.std(lead[(*k, system)]) for k in keys], fmt=marker, color=colour,
                        mfc="none" if system == "layerwise" else colour, ms=5, lw=0.8,
                        label=("transition predictor" if family == "transition" else "oracle (upper bound)")
                        + (", prefetches kept queued" if system == "layerwise_kept" else ", dropped when unstarted"))
    calibrated = [k for k in load if k[0] == "calibrated" and k[2] == "transition"]
    for k in calibrated:
        ax.annotate("calibrated", (load[k], 100 * np.mean(lead[(*k, "layerwise")])), fontsize=7,
                    xytext=(4, -10), textcoords="offset points")
    ax.axhline(100 * PAPER_LOSS, color="tab:red", ls="--", lw=1, label=f"paper {100 * PAPER_LOSS:.1f} %")
    ax.axvline(1.0, color="grey", ls=":", lw=1)
    ax.set_xlabel("prefetch load: 2 copies per layer / PreSched's decode time per MoE layer")
    ax.set_ylabel("throughput lost without PreSched (%)")
    ax.set_title(f"{MODEL} {MACHINE}: every regime, mean ± std over seeds", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def regime_forecasts(rows: list[dict[str, Any]], axis: str) -> list[str]:
    return list(dict.fromkeys(r["forecasts"] for r in rows if r["axis"] == axis))


def best(rows: list[dict[str, Any]]) -> str:
    """The largest mean lead, and where."""
    ours = {key: v for key, v in leads(rows).items() if key[3] in BASELINES}
    (axis, setting, point, system), values = max(ours.items(), key=lambda kv: np.mean(kv[1]))
    top = max((r["ceiling"] for r in rows if r["system"] in BASELINES), default=float("nan"))
    return (f"largest lead: {fmt(values)} ({axis}: {setting}; {forecast_label(point)}; baseline "
            f"{'with prefetches kept queued' if system == 'layerwise_kept' else 'as the mechanism drops them'}); "
            f"largest ceiling (any schedule over layerwise, one seed) {100 * top:.1f} %; "
            f"paper {100 * PAPER_LOSS:.1f} %")


def write_report(out: Path, rows: list[dict[str, Any]], seeds: list[int], wall: float, workers: str) -> None:
    """report.md and the two figures into `out`; `wall`: the study's seconds, run by `workers` (words)."""
    figure(rows, out / "presched_regimes.png")
    backlog_figure(rows, out / "presched_backlog.png")
    text = [f"# PreSched's lead over the greedy per-layer split, by cost regime ({MODEL}, {MACHINE})", "",
            f"LayerScope Fig. 13: {100 * PAPER_LOSS:.1f} % of the throughput lost without PreSched (batch 64). "
            f"Lead = 1 - throughput(layerwise) / throughput(presched), mean ± std over seeds {seeds}; "
            f"{len(rows)} simulated runs in {wall:.0f} s wall under {workers}.", "",
            best(rows), "", table(rows), "", "For scale (the calibrated point):", "", reference_table(rows), "",
            "Prefetch load: the link time of layerwise's two prefetches per MoE layer over PreSched's decode time "
            "per MoE layer; above 1 a link that cannot drop queued copies falls behind and the loads queue behind "
            "a growing backlog.", "", "![leads](presched_regimes.png)", "", "![backlog](presched_backlog.png)", ""]
    (out / "report.md").write_text("\n".join(text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--workers", type=int, default=2, help="parallel jobs (hydra.launcher.n_jobs)")
    ap.add_argument("--axes", default="", help="comma-separated axes to run (default: all)")
    ap.add_argument("--out", default="runs/bench/presched_regimes", help="the multirun folder (a rerun resumes it)")
    ap.add_argument("--fresh", action="store_true", help="rerun every job, even those complete in --out")
    args = ap.parse_args()
    names = [r.name for r in REGIMES if not args.axes or r.axis in args.axes.split(",")]
    if not names:
        raise SystemExit(f"--axes {args.axes}: no such axis; known: {', '.join(dict.fromkeys(r.axis for r in REGIMES))}")
    out = Path(args.out).resolve()
    wall = multirun("presched_regimes", out, args.workers, [f"seed={args.seeds}", f"study.regime={','.join(names)}"],
                    args.fresh)
    from engine.report import load_rows, write_regimes_report  # noqa: E402  (the study's report, by engine.report)

    write_regimes_report(out, out, load_rows(out))
    rows = [r for r in load_rows(out) if "axis" in r]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print((out / "report.md").read_text())
    print(f"{len(rows)} simulated runs, wall {wall:.1f} s with {args.workers} joblib worker(s) (Hydra start included), "
          f"simulation CPU {sum(r['sim_cpu_s'] for r in rows):.1f} s; 1-min load average at the end {load:.2f}; "
          f"report in {out}")


if __name__ == "__main__":
    main()
