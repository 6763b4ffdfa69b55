"""Figures of a routing report (`core.routing_stats.routing_report`), drawn with matplotlib's OO API."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


def _layer_series(report: dict[str, Any], key: str, d: str, sub: str | None = None) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in report["layers"]:
        value = row[key].get(d)
        if value is not None:
            xs.append(row["moe_layer"])
            ys.append(value[sub] if sub else value)
    return xs, ys


def expert_load_figure(report: dict[str, Any]) -> Figure:
    """Heat map of load share relative to uniform (1 = fair share), MoE layer by expert (MoEless Fig. 1)."""
    loads = np.asarray(report["loads"], dtype=np.float64)
    rel = loads / loads.sum(axis=1, keepdims=True) * loads.shape[1]
    fig = Figure(figsize=(max(6.0, 0.12 * loads.shape[1] + 3), max(3.0, 0.3 * loads.shape[0] + 1.5)))
    ax = fig.subplots()
    im = ax.imshow(rel, aspect="auto", cmap="magma", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="load share x num_experts (1 = uniform)")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title(f"Expert load ({report['trace']['model']})")
    return fig


def load_cv_figure(report: dict[str, Any]) -> Figure:
    """Per-layer CV of expert loads (whole trace and mean per step) and mean top-1 gate weight."""
    rows = report["layers"]
    x = [r["moe_layer"] for r in rows]
    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    ax.bar(x, [r["cv"] for r in rows], color="tab:blue", alpha=0.7, label="CV, whole trace")
    ax.plot(x, [r["step_cv_mean"] for r in rows], "o-", color="tab:red", label="CV per step (mean)")
    ax.set_xlabel("MoE layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("coefficient of variation")
    twin = ax.twinx()
    twin.plot(x, [r["top1_weight_mean"] for r in rows], "s--", color="tab:green", label="top-1 gate weight")
    twin.set_ylabel("mean top-1 weight")
    twin.set_ylim(0, 1)
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    ax.set_title("Expert load imbalance per layer")
    return fig


def similarity_figure(report: dict[str, Any]) -> Figure:
    """Cosine similarity of gate inputs between layer l and l + d (MoEless Fig. 7(a))."""
    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    for d in report["trace"]["distances"]:
        xs, ys = _layer_series(report, "similarity", str(d))
        ax.plot(xs, ys, "o-", label=f"d = {d}")
    ax.set_xlabel("MoE layer l")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("cos(gate input l, l + d)")
    ax.legend(fontsize=8)
    ax.set_title("Gate-input similarity across layers")
    return fig


def predictability_figure(report: dict[str, Any]) -> Figure:
    """Top-k hit rate of layer l + d's experts predicted from layer l's (MoEless Fig. 7(b))."""
    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    for i, d in enumerate(report["trace"]["distances"]):
        color = f"C{i}"
        xs, ys = _layer_series(report, "hit_rate", str(d), "transition")
        ax.plot(xs, ys, "o-", color=color, label=f"transition table, d = {d}")
        xs, ys = _layer_series(report, "hit_rate", str(d), "frequency")
        ax.plot(xs, ys, ":", color=color, label=f"frequency, d = {d}")
    ax.axhline(report["summary"]["random_hit_rate"], color="grey", ls="--", label="random (k / E)")
    ax.set_xlabel("source MoE layer l")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("top-k hit rate at l + d")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("Predictability of the next layers' experts (held-out sequences)")
    return fig


def plot_report(report: dict[str, Any], save: Callable[[Figure, str], Path]) -> list[Path]:
    """Draw every figure the report has data for; `save(fig, name)` writes one (e.g. Telemetry.save_figure)."""
    figures = [("expert_load.png", expert_load_figure), ("load_cv.png", load_cv_figure)]
    if any(r["similarity"] for r in report["layers"]):
        figures.append(("gate_similarity.png", similarity_figure))
    if any(r["hit_rate"] for r in report["layers"]):
        figures.append(("predictability.png", predictability_figure))
    return [save(make(report), name) for name, make in figures]
