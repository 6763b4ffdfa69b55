"""Per-layer execution timeline of one forward pass: GPU, CPU and PCIe lanes (LayerScope Figure 3)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from engine.offload.accounting import Event

_COLORS = {"attn": "#9e9e9e", "shared": "#bdbdbd", "dense": "#757575", "head": "#616161", "expert": "#1f77b4",
           "cpu": "#ff7f0e", "ondemand": "#d62728", "staged": "#d62728", "prefetch": "#2ca02c"}


def plot_timeline(events: Sequence[Event], pass_index: int, max_layers: Optional[int] = None, title: str = "") -> Any:
    """A matplotlib figure with one row per lane; bars are labelled by MoE layer."""
    import matplotlib  # heavy, and the headless backend must be chosen before pyplot loads: only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evs = [e for e in events if e.pass_index == pass_index]
    if max_layers is not None:
        last = max((e.end for e in evs if 0 <= e.layer < max_layers), default=float("inf"))
        evs = [e for e in evs if e.layer < max_layers and (e.layer >= 0 or e.start < last)]
    if not evs:
        raise ValueError(f"timeline: no recorded events for pass {pass_index}")
    t0 = min(e.start for e in evs)
    t1 = max(e.end for e in evs)
    fig, ax = plt.subplots(figsize=(12, 2.8))
    lanes = {"link": 0, "cpu": 1, "gpu": 2}
    for e in evs:
        color = _COLORS["cpu"] if e.lane == "cpu" else _COLORS.get(e.kind, "#1f77b4")
        ax.barh(lanes[e.lane], (e.end - e.start) * 1e3, left=(e.start - t0) * 1e3, height=0.6, color=color,
                edgecolor="white", linewidth=0.3)
        width = (e.end - e.start) / max(t1 - t0, 1e-12)
        if e.layer >= 0 and width > 0.02 and (e.lane != "gpu" or e.kind == "attn"):
            ax.text((e.start - t0 + (e.end - e.start) / 2) * 1e3, lanes[e.lane], f"L{e.layer}", ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(list(lanes.values()))
    ax.set_yticklabels(["PCIe", "CPU", "GPU"])
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"forward pass {pass_index}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLORS[k]) for k in ("attn", "expert", "cpu", "ondemand", "prefetch")]
    ax.legend(handles, ["attention", "GPU expert", "CPU expert", "on-demand load", "prefetch"], loc="upper right",
              fontsize=7, ncol=5)
    fig.tight_layout()
    return fig
