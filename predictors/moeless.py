"""MoEless's layer-aware expert load predictor (MoEless §4.1).

For target layer j = l + d: a copy of layer j's gate applied to layer l's gate input. Each layer's
accuracy is profiled on held-out (validation) sequences; only the layers below the threshold h
are fine-tuned (AdamW on the copy's kernel, softmax cross-entropy against the true routing
weights of layer j), one epoch at a time until they reach h or `max_epochs` pass. The best kernel
seen on validation is kept, so a fine-tuned layer is never worse there than its raw copy.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from predictors.config import LoadMetric, MoElessSpec, OptimSpec, PredictorConfig, Schedule
from core.routing_stats import hit_rate, load_accuracy
from core.trace import RoutingTrace
from models.config import ModelConfig
from predictors.base import topk_experts
from predictors.data import LayerPairs, layer_pairs, routing_vector
from predictors.fitting import Checkpoints, fit, scoped
from predictors.gate import GatePredictor, compiled_gate_scores
from predictors.nets import soft_target_ce


class MoElessPredictor(GatePredictor):
    """Gate copies, some fine-tuned; `profile` holds per target layer the accuracy before and after."""

    kind = "moeless"

    def __init__(self, name: str, distance: int, model_cfg: ModelConfig, kernels: dict[int, np.ndarray],
                 biases: dict[int, np.ndarray], profile: Optional[dict[int, dict[str, Any]]] = None):
        super().__init__(name, distance, model_cfg, kernels, biases)
        self.profile = profile or {}


def copy_accuracy(model_cfg: ModelConfig, kernel: Any, bias: Any, pairs: LayerPairs, metric: LoadMetric) -> float:
    """Accuracy of the gate copy `kernel` on `pairs`: per-step load accuracy or per-token hit rate."""
    scores = np.asarray(compiled_gate_scores(model_cfg)(pairs.hidden, kernel, bias))
    predicted = topk_experts(scores, model_cfg.num_experts_per_tok)
    if metric is LoadMetric.hit:
        return hit_rate(predicted, pairs.target, model_cfg.num_experts)
    return load_accuracy(predicted, pairs.target, pairs.step, model_cfg.num_experts)


def _gate_loss(params: dict, consts: dict, batch: tuple, key: Optional[jax.Array]) -> jax.Array:
    hidden, target = batch
    return soft_target_ce(hidden @ params["kernel"], target)


def routing_distribution(pairs: LayerPairs, num_experts: int) -> np.ndarray:
    """float32 [T, E]: the target layer's routing weights, normalised to sum to 1 per token."""
    dist = routing_vector(pairs.target, pairs.target_weights, num_experts)
    total = dist.sum(axis=1, keepdims=True)
    return np.divide(dist, total, out=np.full_like(dist, 1.0 / num_experts), where=total > 0)


def fine_tune_copy(model_cfg: ModelConfig, kernel: np.ndarray, bias: np.ndarray, train: LayerPairs, val: LayerPairs,
                   spec: MoElessSpec, seed: int, checkpoints: Optional[Checkpoints] = None
                   ) -> tuple[np.ndarray, dict[str, Any]]:
    """Profile one copy; fine-tune it if below the threshold. Returns the kernel kept and its record."""
    before = copy_accuracy(model_cfg, kernel, bias, val, spec.metric)
    record: dict[str, Any] = {"before": before, "after": before, "tuned": False, "epochs": 0}
    if before >= spec.threshold:
        return kernel, record
    # the best kernel so far and the epochs run, as arrays: fit checkpoints them, so a resumed fine-tune keeps them
    best = {"acc": np.asarray(before, np.float64), "kernel": np.asarray(kernel), "epochs": np.asarray(0, np.int32)}

    def on_epoch(epoch: int, loss: float, params: dict) -> bool:
        acc = copy_accuracy(model_cfg, params["kernel"], bias, val, spec.metric)
        best["epochs"] = np.asarray(epoch + 1, np.int32)
        if acc > best["acc"]:
            best.update(acc=np.asarray(acc, np.float64), kernel=np.asarray(params["kernel"]))
        return acc >= spec.threshold

    optim = OptimSpec(lr=spec.lr, weight_decay=spec.weight_decay, schedule=Schedule.constant)
    fit({"kernel": jnp.asarray(kernel)}, _gate_loss, {},
        (train.hidden, routing_distribution(train, model_cfg.num_experts)), optim, spec.max_epochs, spec.batch_size,
        seed, on_epoch=on_epoch, cache_key=("moeless",), checkpoints=checkpoints, state=best)
    record.update(after=float(best["acc"]), tuned=True, epochs=int(best["epochs"]))
    return np.asarray(best["kernel"]), record


def fit_moeless(trace: RoutingTrace, train_rows: np.ndarray, val_rows: np.ndarray, cfg: PredictorConfig,
                model_cfg: ModelConfig, kernels: list[np.ndarray], biases: list[np.ndarray],
                name: Optional[str] = None, progress: Any = None, checkpoints: Optional[Checkpoints] = None
                ) -> MoElessPredictor:
    """MoEless predictors at `cfg.distance` from the model's router copies (`predictors.gate.gate_copies`).
    `checkpoints`: this distance's folder; each fine-tuned layer checkpoints (and resumes) in `layer<t>/` under it."""
    d, L = cfg.distance, trace.num_layers
    if len(kernels) != L:
        raise ValueError(f"moeless: {len(kernels)} router copies for a trace with {L} MoE layers")
    if not val_rows.any():
        val_rows = train_rows  # no validation split: profile on the training sequences
    tuned, profile = {}, {}
    targets = list(range(d, L))
    for j in (progress(targets, f"moeless d={d}") if progress else targets):
        train = layer_pairs(trace, j - d, d, train_rows)
        val = layer_pairs(trace, j - d, d, val_rows)
        tuned[j], profile[j] = fine_tune_copy(model_cfg, kernels[j], biases[j], train, val, cfg.moeless,
                                              cfg.seed + 31 * j + d, scoped(checkpoints, f"layer{j}"))
    return MoElessPredictor(name or f"{cfg.name}@d{d}", d, model_cfg, tuned, {j: biases[j] for j in targets}, profile)
