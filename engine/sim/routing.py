"""The `routing` config group: where the simulator's (and the serverless replay's) expert routing comes from,
and the loading of a routing file into a trace shaped like the model.

- `synthetic`: `engine.synthetic_routing` with per-layer-group skew, inter-layer correlation and
  temporal locality (`synthetic.*`); `model_seed` fixes the hot experts, the run's `seed` the traffic.
- `trace`: a recorded routing trace (`core.trace` .npz) at `path`.
- `jsonl`: a vLLM-style JSONL routing log at `path` (`core.trace_import`), replayed as it is:
  `drop_incomplete` drops tokens missing some layer (else the import fails naming the line), `phase=decode`
  reads a decode-only log (every token one decode step; also a per-line `phase` field).
- `hf`: routing saved from a Hugging Face model run with `output_router_logits=True`
  (`core.trace_import.import_hf_router_logits`, a .npz of per-layer router logits).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from core.config import resolve_path, store, unfrozen
from core.trace import RoutingTrace, TraceMeta, load_trace
from core.trace_import import LogPhase, import_hf_router_logits, import_vllm_jsonl
from engine.synthetic_routing import SyntheticRoutingParams
from models.config import ModelConfig


class RoutingSource(enum.Enum):
    synthetic = "synthetic"
    trace = "trace"
    jsonl = "jsonl"
    hf = "hf"


@dataclass(frozen=True)
class RoutingConfig:
    name: str = "synthetic"
    source: RoutingSource = RoutingSource.synthetic
    path: Optional[str] = None  # trace / jsonl / hf file (pkg:<path> inside the repository)
    model_seed: int = 0  # synthetic: the fixed "model" (popularity, affinity maps)
    synthetic: SyntheticRoutingParams = field(default_factory=SyntheticRoutingParams)
    drop_incomplete: bool = False  # jsonl: drop tokens missing some layer's routing (default: fail naming the line)
    phase: LogPhase = LogPhase.auto  # jsonl: auto (first pass of a sequence prefill) | decode (every token a step)

    def __post_init__(self) -> None:
        if not isinstance(self.source, RoutingSource):  # RoutingConfig(source="trace") from Python
            object.__setattr__(self, "source", RoutingSource(self.source))
        if not isinstance(self.phase, LogPhase):
            object.__setattr__(self, "phase", LogPhase(self.phase))


store(unfrozen(RoutingConfig), name="base_routing", group="routing")


def load_routing_file(r: RoutingConfig, cfg: ModelConfig, with_hidden: bool = False) -> RoutingTrace:
    """A recorded (.npz), imported (JSONL) or HF-logged routing trace, checked against the model's shape.
    `with_hidden`: keep a recorded trace's gate inputs (predictors that read them), else leave them on disk."""
    if r.path is None:
        raise ValueError(f"routing.path: required for routing.source={r.source.value}")
    path = resolve_path(r.path)
    if r.source is RoutingSource.jsonl:
        trace = import_vllm_jsonl(path, num_experts=cfg.num_experts, drop_incomplete=r.drop_incomplete,
                                  phase=r.phase, drop_key="routing.drop_incomplete")
    elif r.source is RoutingSource.hf:
        trace = import_hf_router_logits(path, top_k=cfg.num_experts_per_tok)
    else:
        trace = load_trace(path, with_hidden=with_hidden)
    if trace.meta.num_experts != cfg.num_experts or trace.meta.top_k != cfg.num_experts_per_tok:
        raise ValueError(f"routing.path: {path} routes {trace.meta.num_experts} experts top-{trace.meta.top_k}, "
                         f"the model has {cfg.num_experts} top-{cfg.num_experts_per_tok}")
    if trace.num_layers != len(cfg.moe_layers):
        trace = tile_layers(trace, len(cfg.moe_layers))
    return trace


def tile_layers(trace: RoutingTrace, num_layers: int) -> RoutingTrace:
    """A trace with `num_layers` MoE layers made by cycling the recorded layers (a shallow model's
    routing replayed on a deeper model of the same expert count and top-k); meta notes it. Hidden states
    are dropped: a cycled layer's gate input is not that layer's."""
    idx = np.arange(num_layers) % trace.num_layers
    meta = TraceMeta(model=trace.meta.model, num_experts=trace.meta.num_experts, top_k=trace.meta.top_k,
                     moe_layers=tuple(range(num_layers)), hidden_size=trace.meta.hidden_size,
                     family=trace.meta.family, source=trace.meta.source,
                     extra={**trace.meta.extra, "tiled_from_layers": trace.num_layers})
    return RoutingTrace(meta=meta, experts=trace.experts[idx], weights=trace.weights[idx], step=trace.step,
                        batch=trace.batch, seq=trace.seq, pos=trace.pos, token=trace.token, phase=trace.phase)
