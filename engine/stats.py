"""`python -m engine.stats` (`moescope-stats`): per-MoE-layer routing statistics, printed and plotted.

    python -m engine.stats source=trace trace=runs/.../trace.npz        # a moescope routing trace
    python -m engine.stats source=trace trace=routing.jsonl num_experts=8  # a public vLLM routing log
    python -m engine.stats model.checkpoint=<folder> workload=code        # a trained model on a workload

Writes results.json (trace facts, summary, one row per MoE layer, expert loads) and PNG figures
(expert_load, load_cv, gate_similarity when the trace has hidden states, predictability) into the
run folder. Statistics: `core.routing_stats`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from core.config import resolve_path
from conf import hydra_task
from conf.schemas.stats import StatsConfig, StatsSource, TraceFileFormat
from core.routing_stats import routing_report
from engine.stats_plots import plot_report
from core.telemetry import Telemetry, console
from core.trace import RoutingTrace, load_trace
from core.trace_import import import_vllm_jsonl


def load_trace_file(path: str | Path, fmt: TraceFileFormat = TraceFileFormat.auto,
                    num_experts: Optional[int] = None, drop_incomplete: bool = False) -> RoutingTrace:
    """A routing trace from a file: a moescope `.npz` trace or a vLLM routing log (`.jsonl`)."""
    path = Path(path)
    if fmt is TraceFileFormat.auto:
        suffix = path.suffix.lower()
        if suffix not in (".npz", ".jsonl", ".json"):
            raise ValueError(f"trace: cannot tell the format of {path} from its suffix; set trace_format=npz|vllm_jsonl")
        fmt = TraceFileFormat.npz if suffix == ".npz" else TraceFileFormat.vllm_jsonl
    if fmt is TraceFileFormat.npz:
        return load_trace(path)
    return import_vllm_jsonl(path, num_experts=num_experts, drop_incomplete=drop_incomplete)


def trace_from_model(model_node: Any, workload_node: Any, progress: Any = None) -> RoutingTrace:
    """Serve a prompt workload with the model and record its routing, gate inputs included.

    The model needs a tokenizer next to its checkpoint (the shipped trained models have one);
    prompt workloads only (sharegpt, code), as `engine.record` serves them.
    """
    from engine.record import record_trace  # imports jax and the model package: only for source=model

    return record_trace(model_node, workload_node, keep_hidden=True, progress=progress)


def obtain_trace(cfg: StatsConfig, node: DictConfig, progress: Any = None) -> RoutingTrace:
    """The trace the config names: a file (source=trace) or a model run (source=model)."""
    if cfg.source is StatsSource.trace:
        if not cfg.trace:
            raise ValueError("trace: source=trace needs trace=<file> (a .npz routing trace or a vLLM .jsonl log)")
        return load_trace_file(resolve_path(cfg.trace), cfg.trace_format, cfg.num_experts, cfg.drop_incomplete)
    return trace_from_model(node.model, node.workload, progress=progress)


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


def run_stats(cfg: StatsConfig, node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    trace = obtain_trace(cfg, node, tm.progress)
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
    report = run_stats(cfg, node, tm)
    console.print(layer_table(report))
    for note in report["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    return report


if __name__ == "__main__":
    main()
