"""Figures of a serve run, drawn from the results dictionary (so they can be redrawn from results.json).

moe_latency_cdf (Figs. 11/12), total_cost (Fig. 13), latency_vs_memory (Fig. 14),
sensitivity_distance (Figs. 17/18), sensitivity_cv (Figs. 19/20), ablation_cdf (Fig. 21),
balancedness_per_layer (mean / max device load per MoE layer).
"""

from __future__ import annotations

from typing import Any, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _cdf(ax, cdf: dict[str, dict], title: str) -> None:
    for label, pts in cdf.items():
        ax.plot(pts["x_ms"], pts["p"], label=label, drawstyle="steps-post")
    ax.set_xscale("log")
    ax.set_xlabel("MoE layer forward time incl. weight-copy waits (ms)")
    ax.set_ylabel("CDF")
    ax.set_ylim(0, 1.01)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def latency_cdf(cdf: dict[str, dict], title: str) -> Any:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    _cdf(ax, cdf, title)
    return fig


def total_cost(systems: dict[str, dict], title: str) -> Any:
    """Total cost per system under every billing the results carry, the headline one first (solid)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    labels = list(systems)
    first = systems[labels[0]]
    headline = first.get("billing", "held")
    billings = [headline, *(b for b in first.get("cost_by_billing_gib_s", {}) if b != headline)]
    width = 0.8 / len(billings)
    for j, billing in enumerate(billings):
        values = [systems[k].get("cost_by_billing_gib_s", {}).get(billing, systems[k]["total_cost_gib_s"]) for k in labels]
        xs = [i + (j - (len(billings) - 1) / 2) * width for i in range(len(labels))]
        bars = ax.bar(xs, values, width, label=billing + (" (headline)" if j == 0 else ""), alpha=1.0 if j == 0 else 0.45,
                      color=["#999999" if systems[k]["lossy"] else "#4477aa" for k in labels], edgecolor="black",
                      hatch=None if j == 0 else "//")
        for b, v in zip(bars, values):
            ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
    ax.set_ylabel("total inference cost (GiB x s)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return fig


def latency_vs_memory(systems: dict[str, dict], baseline: str, title: str) -> Any:
    """x: time-averaged billed expert memory / the baseline's (held memory under the default billing);
    y: mean MoE-layer speedup over it, waits for weight copies included."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    base = systems[baseline]
    for label, s in systems.items():
        x = s["expert_memory_time_avg_gib"] / base["expert_memory_time_avg_gib"]
        y = base["mean_moe_ms"] / s["mean_moe_ms"] if s["mean_moe_ms"] > 0 else float("nan")
        ax.scatter([x], [y], label=label, marker="x" if s["lossy"] else "o")
        ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel(f"expert memory footprint (normalised to {baseline})")
    ax.set_ylabel(f"MoE layer speedup over {baseline}")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return fig


def sensitivity(systems: dict[str, dict], xs: list[float], xlabel: str, title: str) -> Any:
    """Mean MoE-layer time (left axis) and mean replicas per layer (right axis) over a swept knob."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    labels = list(systems)
    ax.plot(xs, [systems[k]["mean_moe_ms"] for k in labels], "o-", color="#4477aa", label="MoE layer time")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean MoE layer forward time (ms)", color="#4477aa")
    ax2 = ax.twinx()
    ax2.plot(xs, [systems[k]["mean_replicas_per_layer"] for k in labels], "s--", color="#cc6677", label="replicas")
    ax2.set_ylabel("mean expert replicas per layer", color="#cc6677")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return fig


def balancedness_per_layer(per_layer: dict[str, list[float]], title: str) -> Any:
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for label, values in per_layer.items():
        ax.plot(range(len(values)), values, marker=".", label=label)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("balancedness (mean / max device load)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def draw_all(results: dict, title: str) -> dict[str, Any]:
    """Every figure the experiments in `results` support, by file name."""
    exps = results.get("experiments", {})
    figs: dict[str, Any] = {}
    if "compare" in exps:
        c = exps["compare"]
        figs["moe_latency_cdf.png"] = latency_cdf(c["cdf"], f"MoE layer forward time - {title}")
        figs["total_cost.png"] = total_cost(c["systems"], f"Total inference cost - {title}")
        figs["balancedness_per_layer.png"] = balancedness_per_layer(c["balancedness_per_layer"], f"Balancedness - {title}")
    if "memory" in exps:
        m = exps["memory"]["systems"]
        base: Optional[str] = next((k for k in m if k.startswith("Megatron")), next(iter(m)))
        figs["latency_vs_memory.png"] = latency_vs_memory(m, base, f"Latency vs expert memory - {title}")
    if "distance" in exps:
        d = exps["distance"]
        figs["sensitivity_distance.png"] = sensitivity(d["systems"], d["values"], "prediction distance d",
                                                       f"Prediction distance - {title}")
    if "cv_threshold" in exps:
        v = exps["cv_threshold"]
        figs["sensitivity_cv.png"] = sensitivity(v["systems"], v["values"], "CV threshold V", f"CV threshold - {title}")
    if "ablation" in exps:
        figs["ablation_cdf.png"] = latency_cdf(exps["ablation"]["cdf"], f"Ablation - {title}")
    return figs


def close(figs: dict[str, Any]) -> None:
    for fig in figs.values():
        plt.close(fig)
