"""`python -m engine.report <dir>`: a study's tables and figures from its run folders alone.

`<dir>` is a Hydra multirun folder (any launcher: basic, joblib, submitit, Ray; every `results.json` below it,
a study job's `study_rows` each a run) or a benchmark output holding `results.jsonl`. The study is told by its
rows: PreSched regimes (`+experiment=presched_regimes`) -> that study's report and figures; `engine.serve` jobs
(`+experiment=serverless_seeds`) -> the seeds table; `engine.calibrate_paper` jobs (`+experiment=calibration_seeds`)
-> every published point as mean ± std over seeds; otherwise simulated runs (Figure 11 / 13, hit-rate sweep).
Every table and figure also goes to a summary run of the multirun's wandb group (`log_to_wandb`; the mode the
jobs ran in, `--wandb` to change it). For simulated runs it writes into `<dir>` (or `--out`):

- `runs.csv`: one row per run, every scalar metric;
- `report.md`: per model and machine, throughput and decode latency per system x batch size, and
  LayerScope's gain over every other system (throughput up, decode latency down) at every point;
- `fig11_throughput.png`, `fig12_decode_latency.png` (LayerScope Figures 11 / 12: systems vs batch,
  one panel per model and machine) and `fig13_ablation.png` when ablation variants are present;
- for a hit-rate sweep (`engine/bench/bench_simulate_sweep.py --hit-rates ...`): PreSched's decode latency and
  throughput against the forecasts' hit rate, with the measured default and the realistic predictors marked,
  and `hit_rate_sweep.png`.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

REFERENCE = "LayerScope"

# LayerScope's published figures set next to a sweep's (engine/data/layerscope_published.yaml, the points
# `engine.calibrate_paper` fits and checks), by their metric: "gain" LayerScope's throughput gain over `system`,
# "latency_cut" its decode-latency reduction, "ablation" the throughput the ablated variant `system` loses,
# "thr" / "lat" a system's own tokens/s / seconds per decode step.
PUBLISHED = "pkg:engine/data/layerscope_published.yaml"
_REPORTED = {"gain": "gain", "latency_cut": "latency_cut", "ablation": "ablation", "throughput_tok_s": "thr",
             "decode_latency_s": "lat"}


def paper_points(path: str = PUBLISHED) -> list[tuple[str, str, str, int, str, str, float]]:
    """(where, model name, hardware, batch, metric, system label, published value) of every published figure a
    simulated sweep can be set beside."""
    from engine.calibrate_paper import load_points, model_name, scheduler_label  # Hydra + configs: only here

    return [(f"{p.where.split(' (')[0]}, {p.hardware} b{p.batch}", model_name(p.model), p.hardware, p.batch,
             _REPORTED[p.metric], scheduler_label(p.system), p.value)
            for p in load_points(path) if p.evaluate and p.kind != "bound" and p.metric in _REPORTED]


def load_rows(folder: Path) -> list[dict[str, Any]]:
    """Every run below `folder`: `results.json` files (a study job's `study_rows` each a run, tagged with the job's
    folder) and `results.jsonl` lines."""
    if not folder.is_dir():
        raise FileNotFoundError(f"report: {folder} is not a folder")
    rows: list[dict[str, Any]] = []
    for path in sorted(folder.rglob("results.jsonl")):
        with open(path) as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{n}: not JSON: {exc}") from None
    for path in sorted(folder.rglob("results.json"), key=job_order):
        try:
            results = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from None
        if "study_rows" in results:
            job, finished = str(path.parent.relative_to(folder)), job_finished(path)
            rows.extend({**row, "job": job, "finished": finished} for row in results["study_rows"])
        elif "constants" in results and "rows" in results:  # an engine.calibrate_paper job: its points, by seed
            rows.extend({**row, "calibration": True, "seeds": results["seeds"]} for row in results["rows"])
        elif "compare" in (results.get("experiments") or {}):
            rows.append(serve_row(path, results))
        elif frontier_job(results):
            rows.append(frontier_row(path, results))
        else:
            rows.append(results)
    if not rows:
        raise FileNotFoundError(f"report: no results.json / results.jsonl below {folder}")
    return [normalise(r) for r in rows]


def serve_row(path: Path, results: dict[str, Any]) -> dict[str, Any]:
    """An `engine.serve` job of a serverless study as its tables read it (`run_summary`: per system kind its
    metrics, the copy cost model, EPLB's rearrangements), the seed (the job's composed config), the job's wall
    seconds (its job_complete.json) and, for a regimes job, its regime, axis and value."""
    from omegaconf import OmegaConf

    from core.telemetry import JOB_COMPLETE
    from engine.bench.bench_serverless_seeds import run_summary

    composed = path.parent / ".hydra" / "config.yaml"
    seed = int(OmegaConf.load(composed).seed) if composed.is_file() else 0
    marker = path.parent / JOB_COMPLETE
    done = json.loads(marker.read_text()) if marker.is_file() else {}
    return {"serve": True, "seed": seed, **run_summary(results), **results.get("study", {}),
            "wall_s": done.get("finished", float("nan")) - done.get("started", float("nan"))}


def job_finished(results: Path) -> float:
    """When the job that wrote `results` (a results.json) finished: its job_complete.json marker's time, else the
    file's modification time (what tells the newest of several runs of one point apart)."""
    from core.telemetry import JOB_COMPLETE

    marker = results.parent / JOB_COMPLETE
    if marker.is_file():
        try:
            return float(json.loads(marker.read_text())["finished"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            pass  # a damaged marker: the file's own time still orders the runs
    return results.stat().st_mtime


def job_order(path: Path) -> tuple:
    """Multirun jobs in their number's order (2 before 10), whatever the launcher named the folders."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts)


def normalise(row: dict[str, Any]) -> dict[str, Any]:
    """The system label of a row (a synchronous-copy run is its own system)."""
    row = dict(row)
    label = str(row.get("scheduler", row.get("system", "?")))
    if row.get("async_io") is False and "AsyncIO" not in label:
        label += " w/o AsyncIO"
    row["system_label"] = label
    return row


def _fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.{digits}g}"
    return str(x)


def pivot(rows: Iterable[dict[str, Any]], metric: str, spread: bool = False
          ) -> dict[tuple[str, str], dict[str, dict[int, float]]]:
    """(model, hardware) -> system -> batch -> the metric's mean over the runs' seeds (`spread`: its sample std,
    0 for one seed)."""
    values: dict[tuple[str, str], dict[str, dict[int, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        if metric in r and r[metric] is not None:
            values[(r["model"], r["hardware"])][r["system_label"]][int(r["batch_size"])].append(float(r[metric]))
    out: dict[tuple[str, str], dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for key, systems in values.items():
        for system, batches in systems.items():
            for b, v in batches.items():
                out[key][system][b] = (statistics.stdev(v) if len(v) > 1 else 0.0) if spread else statistics.fmean(v)
    return out


def seed_count(rows: Iterable[dict[str, Any]]) -> int:
    """How many routing seeds the runs were replayed on (1 for runs without one)."""
    return len({r.get("seed", 0) for r in rows}) or 1


def gains(table: dict[str, dict[int, float]], higher_is_better: bool) -> dict[str, dict[int, float]]:
    """LayerScope's relative gain over every other system at every batch size."""
    ref = table.get(REFERENCE)
    if not ref:
        return {}
    out: dict[str, dict[int, float]] = {}
    for system, values in table.items():
        if system == REFERENCE:
            continue
        row = {}
        for b, v in values.items():
            if b in ref and v > 0:
                row[b] = ref[b] / v - 1 if higher_is_better else 1 - ref[b] / v
        out[system] = row
    return out


def markdown_table(table: dict[str, dict[int, float]], digits: int = 3, percent: bool = False,
                   spread: Optional[dict[str, dict[int, float]]] = None) -> str:
    """system x batch; with `spread` (the std over seeds) each cell is mean ± std."""
    batches = sorted({b for v in table.values() for b in v})
    lines = ["| system | " + " | ".join(f"b={b}" for b in batches) + " |", "|---|" + "---|" * len(batches)]
    for system in sorted(table, key=lambda s: (s != REFERENCE, s)):
        cells = []
        for b in batches:
            v = table[system].get(b)
            cell = "-" if v is None else (f"{100 * v:+.1f}%" if percent else _fmt(v, digits))
            if v is not None and spread is not None:
                cell += f" ± {_fmt(spread[system][b], 2)}"
            cells.append(cell)
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paper_comparison(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: each of LayerScope's quoted numbers beside the simulated one (where the run exists)."""
    thr, lat = pivot(rows, "throughput_tok_s"), pivot(rows, "decode_latency_s")
    out = []
    for what, model, hw, batch, metric, system, paper in paper_points():
        t, l = thr.get((model, hw), {}), lat.get((model, hw), {})
        ref_t, ref_l = t.get(REFERENCE, {}).get(batch), l.get(REFERENCE, {}).get(batch)
        other_t, other_l = t.get(system, {}).get(batch), l.get(system, {}).get(batch)
        ours: Optional[float] = None
        if metric == "gain" and ref_t and other_t:
            ours, fmt = ref_t / other_t - 1, "pct"
        elif metric == "latency_cut" and ref_l and other_l:
            ours, fmt = 1 - ref_l / other_l, "pct"
        elif metric == "ablation" and ref_t and other_t:
            ours, fmt = 1 - other_t / ref_t, "pct"
        elif metric == "thr" and other_t:
            ours, fmt = other_t, "num"
        elif metric == "lat" and other_l:
            ours, fmt = other_l, "num"
        if ours is None:
            continue
        label = {"gain": f"throughput gain over {system}", "latency_cut": f"latency cut vs {system}",
                 "ablation": f"throughput lost by {system}", "thr": f"{system} tokens/s",
                 "lat": f"{system} s per decode step"}[metric]
        cell = (lambda v: f"{100 * v:+.1f}%") if fmt == "pct" else (lambda v: f"{v:.3g}")
        out.append(f"| {what} | {model} | {label} | {cell(paper)} | {cell(ours)} |")
    if not out:
        return []
    return ["## Beside the paper", "", "| where | model | quantity | paper | simulated |", "|---|---|---|---|---|", *out, ""]


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    keys: list[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in keys and not isinstance(v, (dict, list)):
                keys.append(k)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in keys})
    tmp.replace(path)


def _plot_grid(data: dict[tuple[str, str], dict[str, dict[int, float]]], ylabel: str, path: Path, log: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(data)
    models = sorted({m for m, _ in keys})
    hws = sorted({h for _, h in keys})
    fig, axes = plt.subplots(len(hws), len(models), figsize=(3.4 * len(models), 2.8 * len(hws)), squeeze=False)
    for i, hw in enumerate(hws):
        for j, model in enumerate(models):
            ax = axes[i][j]
            for system, values in sorted(data.get((model, hw), {}).items(), key=lambda kv: (kv[0] != REFERENCE, kv[0])):
                bs = sorted(values)
                ax.plot(bs, [values[b] for b in bs], marker="o", lw=2.2 if system == REFERENCE else 1.1, label=system)
            ax.set_xscale("log", base=2)
            if log:
                ax.set_yscale("log")
            ax.set_title(f"{model} / {hw}", fontsize=8)
            ax.set_xlabel("batch size", fontsize=7)
            ax.set_ylabel(ylabel, fontsize=7)
            ax.tick_params(labelsize=6)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_ablation(data: dict[tuple[str, str], dict[str, dict[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = sorted(data)
    fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.0), squeeze=False)
    for ax, key in zip(axes[0], keys):
        systems = sorted(data[key], key=lambda s: (s != REFERENCE, s))
        batches = sorted({b for v in data[key].values() for b in v})
        width = 0.8 / max(len(systems), 1)
        for k, system in enumerate(systems):
            ax.bar(np.arange(len(batches)) + k * width, [data[key][system].get(b, 0) for b in batches], width, label=system)
        ax.set_xticks(np.arange(len(batches)) + 0.4 - width / 2)
        ax.set_xticklabels([str(b) for b in batches], fontsize=7)
        ax.set_title(f"{key[0]} / {key[1]}", fontsize=8)
        ax.set_ylabel("tokens/s", fontsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=7)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def routing_line(rows: list[dict[str, Any]], model: str, hw: str) -> str:
    """Which routing the runs of one model and machine replayed, with its measured statistics (results.json
    `routing_statistics`: load CV, layer l -> l+1 transition-table hit rate) where the runs report them."""
    seen: dict[str, str] = {}
    for r in rows:
        if r.get("model") != model or r.get("hardware") != hw:
            continue
        name = str(r.get("routing", "unknown"))
        st = r.get("routing_statistics")
        if isinstance(st, dict) and name not in seen:
            extra = f", transition {st['transition_d1']:.2f}" if "transition_d1" in st else ""
            seen[name] = f"{name} (load CV {st['cv_mean']:.2f}{extra})"
        else:
            seen.setdefault(name, name)
    return "Routing: " + "; ".join(seen[k] for k in sorted(seen))


SWEEP_ORDER = {"none": 2.0}  # PreSched without forecasts last; real predictors after the oracle points


def sweep_label(r: dict[str, Any]) -> str:
    """How a hit-rate sweep row's forecasts read in the table."""
    point = str(r["hit_sweep"])
    if point == "measured":
        return "oracle, measured hit rate (default)"
    if point == "none":
        return "no forecasts (PreSched w/o predictor)"
    if r.get("oracle_hit_rate") is None:
        return f"{point} (real, fitted on held-out routing)"
    return f"oracle {float(point):g}"


def hit_rate_section(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: PreSched's decode latency and throughput against the forecasts' d = 1 hit rate (the oracle's
    target, or the measured one of a real predictor), per model, machine and batch, with the measured default's
    source and where the realistic predictors' measured hit rates fall."""
    from engine.sim.measured import realistic_d1

    sweep = [r for r in rows if r.get("hit_sweep") is not None]
    if not sweep:
        return []
    mark_model, marks = realistic_d1()
    lines = ["## PreSched vs forecast hit rate", "",
             "The oracle (an upper bound: the replayed routing degraded to a hit rate) at each swept hit rate, the "
             "same at every distance; `measured` is the simulator's default, LLaPor's measured hit rate per "
             "distance; real predictors run on the same routing. Hit rate: d = 1 top-k, the oracle's target "
             "(realised within sampling noise) or a real predictor's measured one.", ""]
    sources = sorted({str(r["predictor_hit_rate_source"]) for r in sweep if r.get("hit_sweep") == "measured"})
    lines += [f"Measured default's source: {s}" for s in sources] + [""] if sources else []
    lines += [f"Realistic predictors' measured d = 1 hit rates ({mark_model}, held-out sequences; "
              "engine/data/measured_hit_rates.yaml): " + ", ".join(f"{k} {v:.3f}" for k, v in marks.items()), ""]
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in sweep:
        groups[(r["model"], r["hardware"], int(r["batch_size"]))].append(r)
    for (model, hw, batch), rs in sorted(groups.items()):
        perfect = next((r for r in rs if r.get("oracle_hit_rate") == 1.0), None)

        def hit(r: dict[str, Any]) -> float:
            h = r.get("oracle_hit_rate")
            return float(h) if h is not None else float(r.get("predictor_hit_rate", float("nan")))

        def order(r: dict[str, Any]) -> tuple[float, float]:
            return (SWEEP_ORDER.get(str(r["hit_sweep"]), 0.0 if r.get("oracle_hit_rate") is not None else 1.0),
                    -hit(r) if r["hit_sweep"] != "none" else 0.0)

        lines += [f"### {model} on {hw}, batch {batch}", "", routing_line(rs, model, hw), "",
                  "| forecasts | hit rate d = 1 | decode latency (s) | throughput (tok/s) | latency vs oracle 1.0 |",
                  "|---|---|---|---|---|"]
        for r in sorted(rs, key=order):
            h = "-" if r["hit_sweep"] == "none" else f"{hit(r):.3f}"
            rel = "-"
            if perfect is not None and r.get("decode_latency_s") and perfect.get("decode_latency_s"):
                rel = f"{100 * (r['decode_latency_s'] / perfect['decode_latency_s'] - 1):+.1f}%"
            lines.append(f"| {sweep_label(r)} | {h} | {_fmt(r.get('decode_latency_s', float('nan')), 4)} | "
                         f"{_fmt(r.get('throughput_tok_s', float('nan')), 4)} | {rel} |")
        lines.append("")
    return lines


def _plot_hit_rate(rows: list[dict[str, Any]], path: Path) -> None:
    """Decode latency against d = 1 hit rate, one panel per (model, machine, batch): the oracle sweep as a line,
    the measured default starred, real predictors as points, no forecasts dashed, the realistic predictors'
    measured hit rates as dotted verticals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from engine.sim.measured import realistic_d1

    sweep = [r for r in rows if r.get("hit_sweep") is not None and r.get("decode_latency_s")]
    keys = sorted({(r["model"], r["hardware"], int(r["batch_size"])) for r in sweep})
    if not keys:
        return
    _, marks = realistic_d1()
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rs = [r for r in sweep if (r["model"], r["hardware"], int(r["batch_size"])) == key]
        line = sorted((float(r["oracle_hit_rate"]), r["decode_latency_s"]) for r in rs
                      if r.get("oracle_hit_rate") is not None and r["hit_sweep"] != "measured")
        if line:
            ax.plot(*zip(*line), "o-", color="tab:blue", label="oracle (upper bound)")
        for r in rs:
            if r["hit_sweep"] == "measured":
                ax.plot(r["oracle_hit_rate"], r["decode_latency_s"], "*", ms=13, color="tab:red",
                        label="oracle at measured LLaPor (default)")
            elif r["hit_sweep"] == "none":
                ax.axhline(r["decode_latency_s"], ls="--", color="gray", label="no forecasts")
            elif r.get("oracle_hit_rate") is None:
                ax.plot(r["predictor_hit_rate"], r["decode_latency_s"], "s", label=f"{r['hit_sweep']} (real)")
        for name, h in marks.items():
            ax.axvline(h, ls=":", lw=0.8, color="tab:green")
            ax.annotate(name, (h, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=6, va="top")
        ax.set_title(f"{key[0]} / {key[1]} / b{key[2]}", fontsize=8)
        ax.set_xlabel("d = 1 hit rate")
        ax.set_ylabel("decode latency (s)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out: Path, rows: list[dict[str, Any]]) -> Path:
    """Write runs.csv, report.md and the figures into `out`; returns report.md's path."""
    rows = [r if "system_label" in r else normalise(r) for r in rows]
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "runs.csv", rows)
    sweep = [r for r in rows if r.get("hit_sweep") is not None]
    rows = [r for r in rows if r.get("hit_sweep") is None]  # the hit-rate sweep has its own section
    thr = pivot(rows, "throughput_tok_s")
    lat = pivot(rows, "decode_latency_s")
    seeds = seed_count(rows)
    thr_sd = pivot(rows, "throughput_tok_s", spread=True) if seeds > 1 else {}
    lat_sd = pivot(rows, "decode_latency_s", spread=True) if seeds > 1 else {}
    lines = ["# Simulated offloaded inference", "",
             "Throughput = tokens generated / generation time (prefill included); decode latency = seconds per "
             "decode step. Gains are LayerScope's relative to each system (throughput up, latency down)"
             + (f"; mean ± sample std over {seeds} routing seeds, gains of the means." if seeds > 1 else "."), ""]
    summary: dict[str, list[float]] = defaultdict(list)
    worst: list[tuple[float, str]] = []
    for key in sorted(thr):
        model, hw = key
        lines += [f"## {model} on {hw}", "", routing_line(rows, model, hw), "",
                  "Throughput (tokens/s)", "", markdown_table(thr[key], spread=thr_sd.get(key)), ""]
        if key in lat:
            lines += ["Decode latency (s/token)", "", markdown_table(lat[key], 3, spread=lat_sd.get(key)), ""]
        g = gains(thr[key], higher_is_better=True)
        if g:
            lines += ["LayerScope throughput gain", "", markdown_table(g, percent=True), ""]
            for system, per_batch in g.items():
                summary[system].extend(per_batch.values())
                for b, v in per_batch.items():
                    worst.append((v, f"{system} at {model}/{hw}/b={b}"))
        gl = gains(lat.get(key, {}), higher_is_better=False)
        if gl:
            lines += ["LayerScope decode-latency reduction", "", markdown_table(gl, percent=True), ""]
    if summary:
        lines += ["## LayerScope vs each system over the whole sweep", "",
                  "| system | max gain | min gain | points LayerScope >= system |", "|---|---|---|---|"]
        for system, values in sorted(summary.items()):
            ahead = sum(v >= -1e-9 for v in values)
            lines.append(f"| {system} | {100 * max(values):+.1f}% | {100 * min(values):+.1f}% | {ahead}/{len(values)} |")
        lines.append("")
        if worst:
            v, where = min(worst)
            lines += [f"Smallest margin: {100 * v:+.2f}% ({where}).", ""]
    lines += paper_comparison(rows) if rows else []
    lines += hit_rate_section(sweep)
    bounds = [r for r in rows if r.get("lower_bound_s")]
    if bounds:
        lines += ["## Distance to the lower bound", "", "| model | hardware | system | batch | above bound |", "|---|---|---|---|---|"]
        for r in sorted(bounds, key=lambda r: (r["model"], r["hardware"], r["system_label"], r["batch_size"])):
            lines.append(f"| {r['model']} | {r['hardware']} | {r['system_label']} | {r['batch_size']} | "
                         f"{100 * r['above_lower_bound']:+.1f}% |")
        lines.append("")
    path = out / "report.md"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(path)
    if sweep:
        _plot_hit_rate(sweep, out / "hit_rate_sweep.png")
    if thr:
        _plot_grid(thr, "tokens/s", out / "fig11_throughput.png")
    if lat:
        _plot_grid(lat, "s / decode step", out / "fig12_decode_latency.png", log=True)
    if any("w/o" in s for t in thr.values() for s in t):
        _plot_ablation(thr, out / "fig13_ablation.png")
    return path


def write_regimes_report(folder: Path, out: Path, rows: list[dict[str, Any]]) -> Path:
    """The PreSched regimes study (rows with an `axis`): its tables and figures, in the regimes' order."""
    from engine.bench import bench_presched_regimes as regimes  # the study's own tables and figures

    order = {(r.axis, r.setting): i for i, r in enumerate(regimes.REGIMES)}
    rows = sorted(rows, key=lambda r: (order.get((r["axis"], r["setting"]), len(order)), r["forecasts"] != "transition",
                                       r["seed"]))
    seeds = sorted({int(r["seed"]) for r in rows})
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "runs.csv", rows)
    regimes.write_report(out, rows, seeds, multirun_wall(folder), launcher_of(folder))
    return out / "report.md"


def write_calibration_report(folder: Path, out: Path, rows: list[dict[str, Any]]) -> Path:
    """The calibration's comparison over seeds (engine.calibrate_paper jobs, one seed each): every published
    point's simulated figure as mean ± std over the jobs' seeds, its error (of the mean) or its direction."""
    seeds = sorted({s for r in rows for s in r["seeds"]})
    by_point: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_point[r["id"]].append(r)
    lines = ["# Calibration against LayerScope's published figures, over routing seeds", "",
             f"Seeds {seeds}, one engine.calibrate_paper job each ({multirun_wall(folder):.0f} s wall under "
             f"{launcher_of(folder)}); simulated = mean ± sample std over the seeds; error of the mean.", "",
             "| point | kind | role | system | metric | paper | simulated | error / direction |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for point, runs in by_point.items():
        r, values = runs[0], [float(x["simulated"]) for x in runs]
        mean, std = statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0
        if r["kind"] == "relative":
            verdict = "right" if (mean > 0) == (r["paper"] > 0) else "**wrong**"
            cells = (f"{r['paper']:+.3f}", f"{mean:+.3f} ± {std:.3f}", f"{mean:+.1%} vs {r['paper']:+.1%}: {verdict}")
        else:
            cells = (f"{r['paper']:.4g}", f"{mean:.4g} ± {std:.2g}", f"{mean / r['paper'] - 1:+.1%}")
        lines.append(f"| {point} | {r['kind']} | {r['role']} | {r['system']} | {r['metric']} | " + " | ".join(cells) + " |")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_serverless_regimes_report(folder: Path, out: Path, rows: list[dict[str, Any]]) -> Path:
    """The serverless regimes study (engine.serve jobs with a `study.regime`): MoEless against EPLB and
    Megatron-LM at every point, one knob moved at a time (engine.bench.bench_serverless_regimes' table and
    figure)."""
    from engine.bench.bench_serverless_regimes import report

    return report(out, rows, multirun_wall(folder), launcher_of(folder))


def write_horizon_report(folders: list[Path], out: Path, rows: list[dict[str, Any]]) -> Path:
    """The offload-policy study (simulate jobs of kind horizon) over one or several study folders: points x
    policies, mean ± std over seeds, the gap to the bound Horizon closes and every policy's `above_lower_bound`
    (engine.bench.bench_horizon_study); a (point, seed, system) run in several folders counts once, the newest run's
    row (a policy-only rerun beside older all-system runs)."""
    from engine.bench.bench_horizon_study import report

    walls = [w for w in map(multirun_wall, folders) if not math.isnan(w)]
    return report(out, rows, sum(walls) if walls else float("nan"), launcher_of(folders[0]))


def write_serverless_report(folder: Path, out: Path, rows: list[dict[str, Any]]) -> Path:
    """A serverless seeds study (engine.serve jobs): per model, each system's mean ± std over seeds and MoEless's
    relative changes (engine.bench.bench_serverless_seeds' table)."""
    from engine.bench.bench_serverless_seeds import aggregate, markdown

    out.mkdir(parents=True, exist_ok=True)
    summary = aggregate(sorted(rows, key=lambda r: (r["model"], r["seed"])))
    text = ["# MoEless vs Megatron-LM vs EPLB vs Oracle over seeds", "",
            f"{len(rows)} engine.serve runs in {multirun_wall(folder):.0f} s wall under {launcher_of(folder)}.", "",
            markdown(summary)]
    (out / "summary.json").write_text(json.dumps({"models": summary}, indent=1))
    path = out / "report.md"
    path.write_text("\n".join(text))
    return path


def frontier_job(results: dict[str, Any]) -> bool:
    """An engine.serve job of the frontier study (`conf/experiment/serverless_frontier.yaml`)."""
    from engine.serverless.frontier import is_frontier

    return is_frontier(results)


def frontier_row(path: Path, results: dict[str, Any]) -> dict[str, Any]:
    """A frontier job as a report row (engine.serverless.frontier): its seed and wall time from the job's folder."""
    from engine.serverless.frontier import frontier_run, job_seed, job_wall_s

    return frontier_run(path, results, job_seed(path), job_wall_s(path))


def write_frontier(folder: Path, out: Path, rows: list[dict[str, Any]]) -> Path:
    """The frontier study: a table and a figure per (model, routing), MoEless once per forecast source."""
    from engine.serverless.frontier import write_frontier_report

    return write_frontier_report(out, rows, multirun_wall(folder), launcher_of(folder))


def multirun_wall(folder: Path) -> float:
    """Seconds from the first job's start to the last job's end (their job_complete.json markers): the study's
    wall time on whatever ran it, resumed parts counted once; NaN without markers."""
    from core.telemetry import JOB_COMPLETE

    marks = [json.loads(p.read_text()) for p in folder.rglob(JOB_COMPLETE)]
    if not marks:
        return float("nan")
    return max(m["finished"] for m in marks) - min(m["started"] for m in marks)


def launcher_of(folder: Path) -> str:
    """The Hydra launcher that wrote the multirun (`multirun.yaml`), e.g. `the joblib launcher`."""
    path = folder / "multirun.yaml"
    if not path.is_file():  # a folder holding several multiruns (a study's sets): the first one's
        path = next(iter(sorted(folder.rglob("multirun.yaml"))), path)
    if not path.is_file():
        return "an unknown launcher"
    from omegaconf import OmegaConf

    target = str(OmegaConf.load(path).hydra.launcher.get("_target_", "?"))
    return f"the {target.split('.')[-1].replace('Launcher', '').lower() or '?'} launcher"


def markdown_tables(text: str) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Every table of a markdown report as (columns, rows), keyed by the line above it (a heading or caption,
    made a wandb key: lower case, words joined by `_`; repeats numbered)."""
    tables: dict[str, tuple[list[str], list[list[str]]]] = {}
    caption, lines = "table", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"\|\s*:?-{3,}", lines[i + 1].strip()):
            columns = [c.strip() for c in line.strip("|").split("|")]
            body = []
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                body.append((cells + [""] * len(columns))[:len(columns)])
                i += 1
            key = re.sub(r"[^a-z0-9]+", "_", caption.lower()).strip("_")[:60] or "table"
            n, unique = 2, key
            while unique in tables:
                unique, n = f"{key}_{n}", n + 1
            tables[unique] = (columns, body)
            continue
        if line and not line.startswith("!["):
            caption = line.lstrip("#").strip()
        i += 1
    return tables


def wandb_target(folder: Path) -> dict[str, Any]:
    """Where the jobs of a multirun logged (any job's wandb.json): project, entity, group, mode; jobs that ran
    without wandb give the folder's name as the group and mode disabled (`--wandb offline` logs anyway)."""
    from core.telemetry import WANDB_RUN

    for path in sorted(folder.rglob(WANDB_RUN), key=job_order):
        return json.loads(path.read_text())
    return {"project": "moescope", "entity": None, "group": folder.resolve().name, "mode": "disabled"}


def log_to_wandb(folder: Path, out: Path, report: Path, rows: list[dict[str, Any]], mode: Optional[str]) -> Optional[str]:
    """A summary run in the multirun's wandb group: every table of the report as a `wandb.Table` (keys as
    `markdown_tables` names them, plus `runs`, one row per simulated run), every figure as an image, and the
    report's text. Returns the run's folder (None when wandb is disabled)."""
    target = wandb_target(folder)
    mode = mode or str(target.get("mode") or "offline")
    if mode == "disabled":
        return None
    import os

    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    text = report.read_text()
    run = wandb.init(mode=mode, project=target.get("project") or "moescope", entity=target.get("entity"),
                     group=target.get("group"), job_type="report", name=f"report {target.get('group')}",
                     dir=str(out), config={"multirun": str(folder.resolve()), "runs": len(rows)},
                     reinit="finish_previous")
    try:
        payload: dict[str, Any] = {name: wandb.Table(columns=cols, data=body)
                                   for name, (cols, body) in markdown_tables(text).items()}
        scalar = [k for k in dict.fromkeys(k for r in rows for k, v in r.items()
                                           if isinstance(v, (int, float, str, bool)) or v is None)]
        payload["runs"] = wandb.Table(columns=scalar, data=[[r.get(k) for k in scalar] for r in rows])
        payload.update({png.stem: wandb.Image(str(png)) for png in sorted(out.glob("*.png"))})
        payload["report"] = wandb.Html(f"<pre>{text}</pre>")
        run.log(payload)
        return str(run.dir)
    finally:
        run.finish()
        wandb.teardown()  # wait for wandb's service to write the offline log out (finish alone may return first)


def build(folder: Path | Sequence[Path], out: Optional[Path] = None, wandb_mode: Optional[str] = "disabled",
          seeds: Optional[Sequence[int]] = None) -> Path:
    """The report of a multirun folder (or a benchmark output, or several folders of one study: their runs together)
    : each study's tables and figures into `out` (default: the first folder), and, unless `wandb_mode` is
    "disabled", a summary run of the multirun's wandb group (None: the mode its jobs ran in)."""
    folders = [folder] if isinstance(folder, Path) else [Path(f) for f in folder]
    if not folders:
        raise FileNotFoundError("report: no folder given")
    folder = folders[0]
    out = out or folder
    rows = only_seeds([row for f in folders for row in load_rows(f)], seeds)
    if any(r.get("serve") and "axis" in r for r in rows):
        path = write_serverless_regimes_report(folder, out, [r for r in rows if r.get("serve") and "axis" in r])
    elif any(r.get("study") == "horizon" for r in rows):
        path = write_horizon_report(folders, out, [r for r in rows if r.get("study") == "horizon"])
    elif any("axis" in r for r in rows):
        path = write_regimes_report(folder, out, [r for r in rows if "axis" in r])
    elif any(r.get("calibration") for r in rows):
        path = write_calibration_report(folder, out, [r for r in rows if r.get("calibration")])
    elif any(r.get("serve") for r in rows):
        path = write_serverless_report(folder, out, [r for r in rows if r.get("serve")])
    elif any(r.get("frontier") for r in rows):
        path = write_frontier(folder, out, [r for r in rows if r.get("frontier")])
    else:
        path = write_report(out, rows)
    log_to_wandb(folder, out, path, rows, wandb_mode)
    return path


def only_seeds(rows: list[dict[str, Any]], seeds: Optional[Sequence[int]]) -> list[dict[str, Any]]:
    """The runs of routing seeds `seeds` (all with None); a clear error where none is left."""
    if seeds is None:
        return rows
    kept = [r for r in rows if int(r.get("seed", 0)) in set(seeds)]
    if not kept:
        raise ValueError(f"--seeds {','.join(map(str, seeds))}: no run of these seeds (the runs have seeds "
                         f"{sorted({int(r.get('seed', 0)) for r in rows})})")
    return kept


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m engine.report", description="tables and figures from simulated runs")
    ap.add_argument("folder", type=Path, nargs="+",
                    help="Hydra multirun folder (any launcher) or benchmark output; several folders of one study are "
                         "reported together (the offload-policy study: a (point, seed, system) run in several of them "
                         "counts once, the newest run's row)")
    ap.add_argument("--out", type=Path, default=None, help="where to write (default: the folder)")
    ap.add_argument("--wandb", choices=["online", "offline", "disabled"], default=None,
                    help="the summary run's wandb mode (default: the mode the multirun's jobs ran in; none "
                         "when they ran without wandb)")
    ap.add_argument("--seeds", default=None,
                    help="only the runs of these routing seeds, comma-separated (e.g. a policy rerun on seed 0 beside "
                         "older runs of seeds 0-4)")
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    except ValueError:
        raise SystemExit(f"python -m engine.report: --seeds {args.seeds!r}: not a comma-separated list of integers") \
            from None
    try:
        path = build(args.folder, args.out, args.wandb, seeds)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"python -m engine.report: {exc}") from None
    print(f"{sum(len(load_rows(f)) for f in args.folder)} runs -> {path}")


if __name__ == "__main__":
    main()
