"""Figures of `python -m predictors.train` (matplotlib OO API, no pyplot state).

- accuracy per layer for every method (LayerScope Figs. 5 / 14), groups shaded;
- MoEless vs raw gate load accuracy at each prediction distance (MoEless Fig. 15);
- per-step correlation of forecast and true expert loads per layer (MoEless Fig. 16);
- LLaPor before / with online fine-tuning per layer.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from predictors.metrics import per_step_pearson

GROUP_COLOURS = {"input": "#dbe9f6", "middle": "#f3f3f3", "output": "#fbe3d6"}
SET_TITLES = {"test": "in-distribution (ShareGPT test)", "shift": "shifted (code)"}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")


def method_style(index: int) -> dict[str, Any]:
    """A distinct marker, line style and (shrinking) marker size per method, so that methods with equal
    figures (a MoEless copy nobody fine-tuned and its raw gate) stay visible on top of each other."""
    return {"marker": MARKERS[index % len(MARKERS)], "linestyle": LINESTYLES[index % len(LINESTYLES)],
            "markersize": max(3.0, 8.0 - index)}


def _shade_groups(ax: Any, groups: Mapping[str, Sequence[int]]) -> None:
    for name, layers in groups.items():
        if layers:
            ax.axvspan(min(layers) - 0.5, max(layers) + 0.5, color=GROUP_COLOURS.get(name, "#eeeeee"), zorder=0,
                       label=f"{name} group")


def accuracy_figure(methods: Mapping[str, Any], groups: Mapping[str, Sequence[int]], sets: Sequence[str],
                    metrics: Sequence[tuple[str, str]] = (("hit", "top-k hit rate"), ("hot", "hot Top-4 in true Top-6"),
                                                          ("coverage", "token coverage")),
                    model: str = "") -> Figure:
    """One row per metric, one column per evaluation set; one line per method over target layers."""
    fig = Figure(figsize=(5.5 * len(sets), 3.0 * len(metrics)))
    axes = np.atleast_2d(fig.subplots(len(metrics), len(sets), squeeze=False))
    for col, which in enumerate(sets):
        for row, (key, label) in enumerate(metrics):
            ax = axes[row, col]
            _shade_groups(ax, groups)
            for i, (name, res) in enumerate(methods.items()):
                layers = res.get(which, {}).get("layers", {})
                if not layers:
                    continue
                xs = sorted(layers)
                ax.plot(xs, [layers[t][key] for t in xs], label=name, **method_style(i))
            ax.set_ylim(0, 1.02)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("target MoE layer")
            ax.set_ylabel(label)
            if row == 0:
                ax.set_title(f"{model} {SET_TITLES.get(which, which)}".strip())
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8, bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def distance_figure(by_distance: Mapping[str, Mapping[int, Mapping[str, float]]], which: str = "test",
                    model: str = "") -> Figure:
    """Mean load accuracy and hit rate over layers against the prediction distance, per method."""
    fig = Figure(figsize=(10, 3.6))
    axes = fig.subplots(1, 2)
    for ax, (key, label) in zip(axes, (("load_acc", "expert load accuracy"), ("hit", "top-k hit rate"))):
        for i, (name, rows) in enumerate(by_distance.items()):
            ds = sorted(rows)
            ax.plot(ds, [rows[d][key] for d in ds], label=name, **method_style(i))
        ax.set_xlabel("prediction distance d")
        ax.set_ylabel(label)
        ax.set_ylim(0, 1.02)
        ax.set_xticks(sorted({d for rows in by_distance.values() for d in rows}))
    axes[0].set_title(f"{model} {SET_TITLES.get(which, which)}".strip())
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def load_correlation_figure(loads: Mapping[str, Mapping[int, tuple[np.ndarray, np.ndarray]]], model: str = "") -> Figure:
    """MoEless Fig. 16: per target layer, the distribution of per-step Pearson correlations between
    forecast and true tokens per expert (darker: more steps in the bin), one panel per method."""
    bins = np.linspace(-1.0, 1.0, 21)
    fig = Figure(figsize=(4.2 * len(loads), 3.8))
    axes = np.atleast_1d(fig.subplots(1, len(loads), squeeze=False)[0])
    for ax, (name, per_layer) in zip(axes, loads.items()):
        layers = sorted(per_layer)
        grid = np.zeros((len(bins) - 1, len(layers)))
        rs = []
        for i, layer in enumerate(layers):
            r = per_step_pearson(*per_layer[layer])
            r = r[np.isfinite(r)]
            rs.append(r)
            if r.size:
                grid[:, i] = np.histogram(r, bins=bins)[0] / r.size
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="Blues", vmin=0,
                       extent=(min(layers) - 0.5, max(layers) + 0.5, -1.0, 1.0))
        mean = float(np.mean(np.concatenate(rs))) if rs and np.concatenate(rs).size else float("nan")
        ax.set_title(f"{name}: mean r = {mean:.3f}")
        ax.set_xlabel("target MoE layer")
        ax.set_ylabel("Pearson r per step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(im, ax=ax, label="share of steps")
    fig.suptitle(model)
    fig.tight_layout()
    return fig


def online_figure(before: Mapping[str, Any], online: Mapping[str, Any], sets: Sequence[str], model: str = "") -> Figure:
    """Per target layer, LLaPor's hit rate frozen vs with online fine-tuning, per evaluation set."""
    fig = Figure(figsize=(5.5 * len(sets), 3.4))
    axes = np.atleast_1d(fig.subplots(1, len(sets), squeeze=False)[0])
    for ax, which in zip(axes, sets):
        for label, res, style in (("frozen", before.get(which, {}), "o-"), ("online", online.get(which, {}), "s--")):
            layers = res.get("layers", {})
            xs = sorted(layers)
            ax.plot(xs, [layers[t]["hit"] for t in xs], style, label=label)
        ax.set_ylim(0, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("target MoE layer")
        ax.set_ylabel("top-k hit rate")
        ax.set_title(f"{model} {SET_TITLES.get(which, which)}".strip())
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
