"""LLaPor (LayerScope §4.2): one learnable, layer-group-aware predictor per target MoE layer.

For target layer j (forecast from source layer l = j - d):
- features: PCA of the gate input a_l (whitened; `pca_ratio` of the hidden size, stronger
  compression for input/output groups) fused with l's routing (weights scattered onto experts);
- net (`predictors.nets`): input/output groups shallow Linear->GELU->Dropout blocks, middle groups
  deeper with gated residual blocks modulated by PCA(a_l);
- loss: L_expert + lambda * L_focal (input/output; inverse expert frequency of the target layer's
  training data) or BCE (middle), AdamW with the group's learning rate, weight decay and
  schedule (warmup + cosine for input/output), `train.epochs` epochs (optax);
- online fine-tuning (`predictors.online`) on the layers of `online.groups`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from predictors.config import LayerGroup, LossKind, NetSpec, PredictorConfig
from core.trace import RoutingTrace
from predictors.base import LayerContext
from predictors.common import TrainedPredictor
from predictors.data import layer_pairs, multi_hot, routing_vector
from predictors.fitting import Checkpoints, fit, make_step, scoped
from predictors.groups import LayerGroups
from predictors.nets import HOST_OPS, Params, apply_net, bce_loss, host_sigmoid, hybrid_loss, init_net, one_blas_thread
from predictors.online import OnlineMonitor, token_errors
from predictors.pca import fit_pca, pca_dim


def llapor_logits(params: Params, mean: jax.Array, comps: jax.Array, hidden: jax.Array, routing: jax.Array,
                  dropout: float = 0.0, key: Optional[jax.Array] = None) -> jax.Array:
    """hidden [T, H], routing [T, E] -> logits [T, E] of the target layer's experts."""
    z = (hidden - mean) @ comps
    return apply_net(params, jnp.concatenate([z, routing], axis=-1), z, dropout, key)


@one_blas_thread
def llapor_probs_host(params: Params, mean: np.ndarray, comps: np.ndarray, hidden: np.ndarray,
                      routing: np.ndarray) -> np.ndarray:
    """sigmoid(`llapor_logits`) at inference, in numpy: hidden [T, H], routing [T, E] -> float32 [T, E]."""
    z = (hidden - mean) @ comps
    return host_sigmoid(apply_net(params, np.concatenate([z, routing], axis=-1), z, ops=HOST_OPS))


def loss_key(spec: NetSpec) -> tuple:
    """What makes two layers' losses the same function (for sharing compilations)."""
    return ("llapor", spec.loss.value, spec.dropout, spec.focal_lambda, spec.focal_gamma)


def make_loss(spec: NetSpec) -> Callable:
    """loss(net_params, consts = {inv_freq, mean, comps}, (hidden, routing, y, mask), key) of a layer group."""

    def loss(params: Params, consts: dict, batch: tuple, key: Optional[jax.Array]) -> jax.Array:
        hidden, routing, y, mask = batch
        logits = llapor_logits(params, consts["mean"], consts["comps"], hidden, routing, spec.dropout, key)
        if spec.loss is LossKind.hybrid:
            return hybrid_loss(logits, y, consts["inv_freq"], spec.focal_lambda, spec.focal_gamma, mask)
        return bce_loss(logits, y, mask)

    return loss


@dataclass
class LayerNet:
    """The predictor of one target layer."""

    group: LayerGroup
    net: Params
    mean: np.ndarray  # float32 [H]
    comps: np.ndarray  # float32 [H, p]: whitened PCA directions
    inv_freq: np.ndarray  # float32 [E]: 1 / f_i of the target layer's training data

    def arrays(self) -> dict[str, Any]:
        return {"net": self.net, **self.consts()}

    def consts(self) -> dict[str, np.ndarray]:
        return {"mean": self.mean, "comps": self.comps, "inv_freq": self.inv_freq}


class LLaPorPredictor(TrainedPredictor):
    kind = "llapor"

    def __init__(self, name: str, cfg: PredictorConfig, num_layers: int, num_experts: int, top_k: int,
                 groups: LayerGroups, layers: dict[int, LayerNet]):
        super().__init__(name, cfg.distance, num_layers, num_experts, top_k)
        missing = sorted(set(self.targets) - set(layers))
        if missing:
            raise ValueError(f"{name}: no trained net for target layers {missing}")
        self.cfg = cfg
        self.groups = groups
        self.layers = layers
        self._device = {t: {k: jax.tree_util.tree_map(jnp.asarray, v) for k, v in ln.arrays().items()}
                        for t, ln in layers.items()}
        # forecasts run in numpy: a few tokens' forward is far quicker there than a device call
        self._host = {t: {k: jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), v)
                          for k, v in ln.arrays().items()} for t, ln in layers.items()}
        self._monitors: dict[int, OnlineMonitor] = {}
        self._steps: dict[int, tuple[Callable, Any]] = {}
        self._key = jax.random.PRNGKey(cfg.seed + 7919)

    def spec(self, target: int) -> NetSpec:
        return self.cfg.llapor.net(self.layers[target].group)

    # ---- forecasting ------------------------------------------------------------------------------------------
    def scores(self, target: int, ctx: LayerContext) -> np.ndarray:
        hidden = self.require_hidden(ctx)
        routing = routing_vector(ctx.experts, ctx.weights, self.num_experts)
        h = self._host[target]
        return llapor_probs_host(h["net"], h["mean"], h["comps"], hidden.astype(np.float32), routing.astype(np.float32))

    # ---- online fine-tuning ------------------------------------------------------------------------------------
    def online_layers(self) -> list[int]:
        online = self.cfg.llapor.online
        if not online.enabled:
            return []
        return [t for t in self.targets if self.layers[t].group in online.groups]

    def monitor(self, target: int) -> OnlineMonitor:
        if target not in self._monitors:
            H = self.layers[target].mean.shape[0]
            self._monitors[target] = OnlineMonitor(self.cfg.llapor.online, (H, self.num_experts, self.num_experts))
        return self._monitors[target]

    def learn(self, target: int, ctx: LayerContext, actual: np.ndarray, predicted: np.ndarray) -> None:
        if target not in self.online_layers():
            return
        hidden = self.require_hidden(ctx)
        routing = routing_vector(ctx.experts, ctx.weights, self.num_experts)
        mon = self.monitor(target)
        if mon.push(token_errors(predicted, actual), hidden, routing, multi_hot(actual, self.num_experts)):
            self.fine_tune(target)
            mon.start_over()

    def _online_step(self, target: int) -> tuple[Callable, Any]:
        """(jitted AdamW step, optimiser state) of `target`'s online fine-tuning, built on first use."""
        if target not in self._steps:
            online = self.cfg.llapor.online
            tx = optax.adamw(online.lr, weight_decay=online.weight_decay)
            spec = self.spec(target)
            step_fn = make_step(make_loss(spec), tx, (loss_key(spec), online.lr, online.weight_decay))
            self._steps[target] = (step_fn, tx.init(self._device[target]["net"]))
        return self._steps[target]

    def _online_args(self, target: int) -> tuple[Any, dict, tuple]:
        """(params, consts, batch) of one fine-tuning step on `target`'s buffered runtime data."""
        (hidden, routing, y), mask = self.monitor(target).batch()
        consts = {k: self._device[target][k] for k in ("mean", "comps", "inv_freq")}
        return self._device[target]["net"], consts, tuple(jnp.asarray(a) for a in (hidden, routing, y, mask))

    def warm_up(self) -> None:
        """Compile the online fine-tuning step of every online layer now, outside timed work: its first cycle
        would otherwise stall a decode step by a compilation far longer than the cycle itself.
        One step on an empty buffer, its result discarded: the nets are unchanged."""
        for target in self.online_layers():
            step, opt_state = self._online_step(target)
            params, consts, batch = self._online_args(target)
            _, sub = jax.random.split(self._key)  # (the key is not advanced: fine-tuning draws as without warm-up)
            jax.block_until_ready(step(params, opt_state, consts, batch, sub))

    def fine_tune(self, target: int) -> float:
        """One cycle (`online.steps` AdamW steps) on the layer's buffered runtime data; returns the last loss."""
        online = self.cfg.llapor.online
        step, opt_state = self._online_step(target)
        params, consts, batch = self._online_args(target)
        loss: Any = 0.0
        for _ in range(online.steps):
            self._key, sub = jax.random.split(self._key)
            params, opt_state, loss = step(params, opt_state, consts, batch, sub)
        self._steps[target] = (step, opt_state)
        self._device[target]["net"] = params  # `layers[target].net` is refreshed when the arrays are read
        self._host[target]["net"] = jax.tree_util.tree_map(np.asarray, params)
        return float(loss)

    def online_cycles(self) -> dict[int, int]:
        return {t: m.cycles for t, m in self._monitors.items()}

    # ---- persistence -------------------------------------------------------------------------------------------
    def layer_arrays(self) -> dict[int, Any]:
        for t in self._steps:  # layers fine-tuned online: bring their nets back from the device
            self.layers[t].net = jax.tree_util.tree_map(np.asarray, self._device[t]["net"])
        return {t: jax.tree_util.tree_map(np.asarray, self.layers[t].arrays()) for t in self.targets}


def fit_layer(trace: RoutingTrace, rows: np.ndarray, target: int, distance: int, group: LayerGroup,
              spec: NetSpec, epochs: int, batch_size: int, seed: int, checkpoints: Optional[Checkpoints] = None
              ) -> tuple[LayerNet, list[float]]:
    """Train the net of one target layer on the rows `rows`; returns it and the loss per epoch.
    `checkpoints`: this layer's own folder (the PCA and frequencies are recomputed: a pure function of the rows)."""
    pairs = layer_pairs(trace, target - distance, distance, rows)
    E = trace.meta.num_experts
    H = pairs.hidden.shape[1]
    pca = fit_pca(pairs.hidden, pca_dim(H, spec.pca_ratio, spec.pca_min_dim), whiten=True)
    y = multi_hot(pairs.target, E)
    inv_freq = (1.0 / np.maximum(y.mean(axis=0), spec.min_frequency)).astype(np.float32)
    routing = routing_vector(pairs.experts, pairs.weights, E)
    net = init_net(seed * 1009 + target, pca.dim + E, pca.dim, E, spec.width, spec.blocks, spec.residual_blocks, spec.residual_depth)
    consts = {"mean": pca.mean, "comps": pca.components, "inv_freq": inv_freq}
    mask = np.ones(len(y), np.float32)
    result = fit(net, make_loss(spec), consts, (pairs.hidden, routing, y, mask), spec.optim, epochs, batch_size,
                 seed + target, cache_key=loss_key(spec), checkpoints=checkpoints)
    net = jax.tree_util.tree_map(np.asarray, result.params)
    return LayerNet(group=group, net=net, mean=pca.mean, comps=pca.components, inv_freq=inv_freq), result.epoch_loss


def fit_llapor(trace: RoutingTrace, rows: np.ndarray, cfg: PredictorConfig, groups: LayerGroups,
               name: Optional[str] = None, progress: Any = None, checkpoints: Optional[Checkpoints] = None
               ) -> tuple[LLaPorPredictor, dict[int, list[float]]]:
    """Train every target layer's net on the training rows; returns the predictor and per-layer epoch losses.
    `checkpoints`: the method's folder; each target layer checkpoints (and resumes) in `layer<t>/` under it."""
    L, d = trace.num_layers, cfg.distance
    targets = list(range(d, L))
    layers, losses = {}, {}
    for target in (progress(targets, "llapor") if progress else targets):
        group = groups.of(target)
        spec = cfg.llapor.net(group)
        layers[target], losses[target] = fit_layer(trace, rows, target, d, group, spec, cfg.train.epochs,
                                                   cfg.train.batch_size, cfg.seed,
                                                   scoped(checkpoints, f"layer{target}"))
    pred = LLaPorPredictor(name or cfg.name, cfg, L, trace.meta.num_experts, trace.meta.top_k, groups, layers)
    return pred, losses
