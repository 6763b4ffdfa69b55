"""`python -m engine.stats` (`moescope-stats`): per-MoE-layer routing statistics, printed and plotted.

    python -m engine.stats source=trace trace=runs/.../trace.npz        # a moescope routing trace
    python -m engine.stats source=trace trace=routing.jsonl num_experts=8  # a public vLLM routing log
    python -m engine.stats model.checkpoint=<folder> workload=code        # a trained model on a workload

Writes results.json (trace facts, summary, one row per MoE layer, expert loads) and PNG figures
(expert_load, load_cv, gate_similarity when the trace has hidden states, predictability) into the
run folder. Statistics: `core.routing_stats`.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from conf import hydra_task
from conf.schemas.stats import StatsConfig, StatsSource
from core.routing_stats import routing_report
from core.telemetry import Telemetry, console
from core.trace import RoutingTrace
from engine.record import obtain_trace
from engine.stats_plots import plot_report


def stats_trace(cfg: StatsConfig, progress: Any = None) -> RoutingTrace:
    """The trace the config names: a file (source=trace) or the model serving the workload (source=model)."""
    if cfg.source is StatsSource.trace and not cfg.trace:
        raise ValueError("trace: source=trace needs trace=<file> (a .npz routing trace or a vLLM .jsonl log)")
    path = cfg.trace if cfg.source is StatsSource.trace else None
    return obtain_trace(path, cfg.model, cfg.workload, fmt=cfg.trace_format, num_experts=cfg.num_experts,
                        drop_incomplete=cfg.drop_incomplete, keep_hidden=True, progress=progress)


def layer_table(report: dict[str, Any]) -> Table:
    """A rich table, one row per MoE layer, of the headline statistics at distance 1."""
    table = Table(title=f"routing statistics: {report['trace']['model']}", header_style="bold")
    for name in ("layer", "CV", "step CV", "max share", "hot experts", "top-1 w", "cos d=1", "hit d=1",
                 "freq d=1"):
        table.add_column(name, justify="right")

    def fmt(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}"

    for r in report["layers"]:
        hit = r["hit_rate"].get("1", {})
        hot = r["hot_experts"]
        table.add_row(str(r["moe_layer"]), fmt(r["cv"]), fmt(r["step_cv_mean"]), fmt(r["max_share"]),
                      ",".join(map(str, hot[:6])) + ("…" if len(hot) > 6 else ""), fmt(r["top1_weight_mean"]),
                      fmt(r["similarity"].get("1")), fmt(hit.get("transition")), fmt(hit.get("frequency")))
    return table


def run_stats(cfg: StatsConfig, tm: Telemetry) -> dict[str, Any]:
    trace = stats_trace(cfg, tm.progress)
    if cfg.source is StatsSource.model and cfg.save_trace:
        trace.save(tm.run_dir / "trace.npz")
    report = routing_report(trace, cfg.distances, cfg.hot_factor, cfg.test_fraction, cfg.split_seed)
    report["plots"] = [p.name for p in plot_report(report, tm.save_figure)] if cfg.plots else []
    return report


def headline(report: dict[str, Any]) -> dict[str, Any]:
    return {"rows": report["trace"]["rows"], "sequences": report["trace"]["sequences"], **report["summary"]}


@hydra_task("stats", summarize=headline, metrics=lambda report: report["summary"])
def main(node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    cfg: StatsConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    report = run_stats(cfg, tm)
    console.print(layer_table(report))
    for note in report["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    return report


if __name__ == "__main__":
    main()
