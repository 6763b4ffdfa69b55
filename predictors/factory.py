"""`load_predictor`: the one way consumers (simulator, offload executor, serving loop) get a predictor.

    from predictors import load_predictor
    pred = load_predictor(cfg.predictor, model=model, trace=trace)   # any conf/predictor/*.yaml node

- `kind: oracle` reads the trace being replayed (`trace=`), degraded to `oracle.hit_rate`
  (times `oracle.distance_decay` per layer of distance beyond the first);
- `checkpoint: <folder>` loads a predictor trained by `python -m predictors.train` (any kind);
- `kind: gate` without a checkpoint copies the routers of `model=` (no training needed);
- stats / token / llapor / moeless need a checkpoint.
"""

from __future__ import annotations

from typing import Any, Optional

from core.config import resolve_path
from predictors.config import PredictorKind
from core.trace import RoutingTrace
from predictors.base import Predictor
from predictors.checkpoint import load_predictor_folder
from predictors.config import predictor_config
from predictors.gate import GatePredictor
from predictors.oracle import NoisyOraclePredictor


def load_predictor(node_or_cfg: Any, model: Any = None, trace: Optional[RoutingTrace] = None,
                   distance: Optional[int] = None) -> Predictor:
    """A `predictors.base.Predictor` from a `predictor` config node (or dict / `PredictorConfig`).

    `model`: an `MoETransformer` (gate predictors without a checkpoint; checks the checkpoint's shapes);
    `trace`: the routing trace being replayed (oracle); `distance` overrides `predictor.distance`.
    """
    cfg = predictor_config(node_or_cfg)
    d = int(distance if distance is not None else cfg.distance)
    if cfg.kind is PredictorKind.oracle:
        if trace is None:
            raise ValueError("predictor.kind=oracle: pass the routing trace being replayed (trace=...)")
        hit = cfg.oracle.hit_rate * cfg.oracle.distance_decay ** (d - 1)
        return NoisyOraclePredictor(trace, d, hit, cfg.seed, name=cfg.name if hit >= 1.0 else f"{cfg.name}@{hit:g}")
    if cfg.checkpoint:
        folder = resolve_path(cfg.checkpoint)
        pred = load_predictor_folder(folder)
        if pred.kind != cfg.kind.value:
            raise ValueError(f"predictor.checkpoint={cfg.checkpoint} holds a {pred.kind} predictor, "
                             f"but predictor.kind={cfg.kind.value}")
        if pred.distance != d:
            raise ValueError(f"predictor.checkpoint={cfg.checkpoint} predicts distance {pred.distance}, "
                             f"but predictor.distance={d}")
        if model is not None:
            check_model(pred, model.cfg, f"predictor.checkpoint={cfg.checkpoint}")
        if trace is not None:
            check_shape(pred, trace.num_layers, trace.meta.num_experts, f"predictor.checkpoint={cfg.checkpoint}")
        return pred
    if cfg.kind is PredictorKind.gate:
        if model is None:
            raise ValueError("predictor.kind=gate: pass the model (its routers are copied) or set predictor.checkpoint")
        return GatePredictor.from_model(model, d, name=cfg.name if d == 1 else f"{cfg.name}@d{d}")
    raise ValueError(f"predictor.kind={cfg.kind.value}: set predictor.checkpoint to a folder written by "
                     "`python -m predictors.train`")


def check_shape(pred: Any, num_layers: int, num_experts: int, where: str) -> None:
    if (pred.num_layers, pred.num_experts) != (num_layers, num_experts):
        raise ValueError(f"{where}: trained for {pred.num_layers} MoE layers x {pred.num_experts} experts, "
                         f"not {num_layers} x {num_experts}")


def check_model(pred: Any, model_cfg: Any, where: str) -> None:
    check_shape(pred, len(model_cfg.moe_layers), model_cfg.num_experts, where)
    saved = getattr(pred, "model_cfg", None)
    if saved is not None and saved.hidden_size != model_cfg.hidden_size:
        raise ValueError(f"{where}: gate copies of hidden size {saved.hidden_size}, model has {model_cfg.hidden_size}")
