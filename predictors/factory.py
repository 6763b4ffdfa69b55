"""`load_predictor`: the one way consumers (simulator, offload executor, serving loop) get a predictor.

    from predictors import load_predictor
    pred = load_predictor(cfg.predictor, model=model, trace=trace)   # any conf/predictor/*.yaml node

- `kind: oracle` reads the trace being replayed (`trace=`), degraded to `oracle.hit_rates[d - 1]` where given,
  else `oracle.hit_rate` (times `oracle.distance_decay` per layer of distance beyond the first or the list);
- `checkpoint: <folder>` loads a predictor trained by `python -m predictors.train` (any kind);
- `kind: gate` without a checkpoint copies the routers of `model=` (no training needed);
- `kind: stats | transition` without a checkpoint are fitted on `train=` (routing of the same model held
  out of the replay: the simulator's profiling routing);
- token / llapor / moeless need a checkpoint.

`make_predictors` builds one per forecast distance for the offload executor and the simulator.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import numpy as np

from core.config import resolve_path
from predictors.config import PredictorKind
from core.trace import RoutingTrace
from predictors.base import Predictor
from predictors.config import PredictorConfig, predictor_config
from predictors.oracle import NoisyOraclePredictor

log = logging.getLogger(__name__)


def load_predictor(node_or_cfg: Any, model: Any = None, trace: Optional[RoutingTrace] = None,
                   distance: Optional[int] = None, train: Optional[RoutingTrace] = None) -> Predictor:
    """A `predictors.base.Predictor` from a `predictor` config node (or dict / `PredictorConfig`).

    `model`: an `MoETransformer` (gate predictors without a checkpoint; checks the checkpoint's shapes);
    `trace`: the routing trace being replayed (oracle); `distance` overrides `predictor.distance`;
    `train`: routing to fit a stats / transition predictor on when no checkpoint is given.
    """
    cfg = predictor_config(node_or_cfg)
    d = int(distance if distance is not None else cfg.distance)
    if cfg.kind is PredictorKind.oracle:
        if trace is None:
            raise ValueError("predictor.kind=oracle: pass the routing trace being replayed (trace=...)")
        hit = cfg.oracle.at(d)
        seed = cfg.seed + 7919 * (d - 1)  # one miss pattern per distance, not the same draws at every distance
        return NoisyOraclePredictor(trace, d, hit, seed, name=cfg.name if hit >= 1.0 else f"{cfg.name}@{hit:g}")
    # jax, flax and orbax come with checkpoints and gate copies only: the oracle (the simulator's default) and the
    # routing-only predictors fitted here stay light (a study's worker processes never import jax)
    from predictors.stats import StatsPredictor
    from predictors.transition import TransitionPredictor

    if cfg.checkpoint:
        from predictors.checkpoint import load_predictor_folder

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
    if cfg.kind in (PredictorKind.stats, PredictorKind.transition) and train is not None:
        name = cfg.name if d == 1 else f"{cfg.name}@d{d}"
        if trace is not None and train.num_layers != trace.num_layers:
            raise ValueError(f"predictor.kind={cfg.kind.value}: training routing of {train.num_layers} MoE layers, the "
                             f"replayed routing has {trace.num_layers}")
        every = np.ones(train.num_rows, bool)
        if cfg.kind is PredictorKind.stats:
            return StatsPredictor.fit(train, every, name, d, cfg.stats.online)
        return TransitionPredictor.fit(train, every, name, d)
    if cfg.kind is PredictorKind.gate:
        from predictors.gate import GatePredictor

        if model is None:
            raise ValueError("predictor.kind=gate: pass the model (its routers are copied) or set predictor.checkpoint")
        return GatePredictor.from_model(model, d, name=cfg.name if d == 1 else f"{cfg.name}@d{d}")
    raise ValueError(f"predictor.kind={cfg.kind.value}: set predictor.checkpoint to a folder written by "
                     "`python -m predictors.train`")


def make_predictors(cfg: PredictorConfig, distances: Sequence[int], model: Any = None,
                    trace: Optional[RoutingTrace] = None, train: Optional[RoutingTrace] = None) -> dict[int, Predictor]:
    """One predictor per forecast distance the scheduler may read (`distances`), for the offload executor and
    the simulator alike. A trained checkpoint predicts its own distance only: it serves that one (an error when
    the scheduler never reads it), and the further distances get no forecast, which is logged."""
    cfg = predictor_config(cfg)
    wanted = sorted({int(d) for d in distances})
    if not cfg.checkpoint:
        return {d: load_predictor(cfg, model=model, trace=trace, distance=d, train=train) for d in wanted}
    d = int(cfg.distance)
    if d not in wanted:
        raise ValueError(f"predictor.checkpoint={cfg.checkpoint} predicts distance {d} (predictor.distance), but the "
                         f"scheduler reads forecasts at distances {wanted}; train one for distance {min(wanted)} or "
                         f"widen the scheduler's window (scheduler.max_window={d}; engine.run: predictor_distances)")
    if wanted != [d]:
        log.warning("predictor.checkpoint=%s predicts distance %d only: no forecasts at distances %s, so the "
                    "scheduler's window stops at %d (scheduler.max_window=%d says so explicitly)", cfg.checkpoint, d,
                    [x for x in wanted if x != d], d, d)
    return {d: load_predictor(cfg, model=model, trace=trace, distance=d)}


def check_shape(pred: Any, num_layers: int, num_experts: int, where: str) -> None:
    if (pred.num_layers, pred.num_experts) != (num_layers, num_experts):
        raise ValueError(f"{where}: trained for {pred.num_layers} MoE layers x {pred.num_experts} experts, "
                         f"not {num_layers} x {num_experts}")


def check_model(pred: Any, model_cfg: Any, where: str) -> None:
    check_shape(pred, len(model_cfg.moe_layers), model_cfg.num_experts, where)
    saved = getattr(pred, "model_cfg", None)
    if saved is not None and saved.hidden_size != model_cfg.hidden_size:
        raise ValueError(f"{where}: gate copies of hidden size {saved.hidden_size}, model has {model_cfg.hidden_size}")
