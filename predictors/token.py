"""The token-based predictor (LayerScope §3.2; ExpertFlow / SiDA style): a light net from the token's
embedding (and the source layer's routing: token-expert and expert-expert correlation) to the
experts of the target layer.

The model's input embedding is compressed once by PCA (`token.embed_dim`, whitened) into a table
shared by every layer; per target layer one Linear -> GELU -> Dropout block and a linear head,
trained with BCE (optax AdamW).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from predictors.config import PredictorConfig, TokenSpec
from core.trace import RoutingTrace
from predictors.base import LayerContext
from predictors.common import TrainedPredictor, pad_rows, row_bucket
from predictors.data import layer_pairs, multi_hot, routing_vector
from predictors.fitting import Checkpoints, fit, scoped
from predictors.nets import Params, apply_net, bce_loss, init_net
from predictors.pca import fit_pca


def token_logits(params: Params, table: jax.Array, tokens: jax.Array, routing: jax.Array, use_routing: bool,
                 dropout: float = 0.0, key: Optional[jax.Array] = None) -> jax.Array:
    """tokens int [T], routing [T, E] -> logits [T, E]."""
    z = table[tokens]
    feats = jnp.concatenate([z, routing], axis=-1) if use_routing else z
    return apply_net(params, feats, z, dropout, key)


@functools.partial(jax.jit, static_argnames=("use_routing",))
def _token_probs(params: Params, table: jax.Array, tokens: jax.Array, routing: jax.Array, use_routing: bool) -> jax.Array:
    return jax.nn.sigmoid(token_logits(params, table, tokens, routing, use_routing))


def make_loss(spec: TokenSpec) -> Callable:
    def loss(params: Params, consts: dict, batch: tuple, key: Optional[jax.Array]) -> jax.Array:
        tokens, routing, y = batch
        return bce_loss(token_logits(params, consts["table"], tokens, routing, spec.use_routing, spec.dropout, key), y)

    return loss


def embedding_table(embedding: np.ndarray, dim: int) -> np.ndarray:
    """float32 [V, dim]: the whitened PCA of the model's token embedding rows [V, H]."""
    return fit_pca(np.asarray(embedding, np.float32), min(dim, embedding.shape[1]), whiten=True).transform(embedding)


class TokenPredictor(TrainedPredictor):
    kind = "token"

    def __init__(self, name: str, cfg: PredictorConfig, num_layers: int, num_experts: int, top_k: int,
                 table: np.ndarray, nets: dict[int, Params]):
        super().__init__(name, cfg.distance, num_layers, num_experts, top_k)
        missing = sorted(set(self.targets) - set(nets))
        if missing:
            raise ValueError(f"{name}: no trained net for target layers {missing}")
        self.cfg = cfg
        self.table = np.asarray(table, np.float32)
        self.nets = nets
        self._table = jnp.asarray(self.table)
        self._nets = {t: jax.tree_util.tree_map(jnp.asarray, p) for t, p in nets.items()}

    def scores(self, target: int, ctx: LayerContext) -> np.ndarray:
        if ctx.tokens is None or np.any(np.asarray(ctx.tokens) < 0):
            raise ValueError(f"{self.name}: LayerContext.tokens (known token ids) is required")
        tokens = np.asarray(ctx.tokens, np.int64)
        if tokens.size and tokens.max() >= self.table.shape[0]:
            raise ValueError(f"{self.name}: token id {int(tokens.max())} outside the vocabulary of {self.table.shape[0]}")
        routing = routing_vector(ctx.experts, ctx.weights, self.num_experts)
        n, b = tokens.shape[0], row_bucket(tokens.shape[0])
        out = _token_probs(self._nets[target], self._table, pad_rows(tokens, b), pad_rows(routing, b),
                           self.cfg.token.use_routing)
        return np.asarray(out)[:n]

    def layer_arrays(self) -> dict[int, Any]:
        return {t: jax.tree_util.tree_map(np.asarray, p) for t, p in self.nets.items()}

    def shared_arrays(self) -> Any:
        return {"table": self.table}


def fit_token(trace: RoutingTrace, rows: np.ndarray, cfg: PredictorConfig, embedding: np.ndarray,
              name: Optional[str] = None, progress: Any = None, checkpoints: Optional[Checkpoints] = None
              ) -> tuple[TokenPredictor, dict[int, list[float]]]:
    """Train the token predictor of every target layer; `embedding` is the model's input embedding [V, H].
    `checkpoints`: the method's folder; each target layer checkpoints (and resumes) in `layer<t>/` under it."""
    spec, d, E = cfg.token, cfg.distance, trace.meta.num_experts
    if np.any(trace.token[rows] < 0):
        raise ValueError("token predictor: the training trace has unknown token ids (-1); record it with a model")
    table = embedding_table(embedding, spec.embed_dim)
    q = table.shape[1]
    targets = list(range(d, trace.num_layers))
    nets, losses = {}, {}
    for target in (progress(targets, "token") if progress else targets):
        pairs = layer_pairs(trace, target - d, d, rows, with_hidden=False)
        routing = routing_vector(pairs.experts, pairs.weights, E)
        y = multi_hot(pairs.target, E)
        net = init_net(cfg.seed * 1013 + target, q + (E if spec.use_routing else 0), q, E,
                       spec.width, 1)
        result = fit(net, make_loss(spec), {"table": table}, (pairs.tokens, routing, y), spec.optim, cfg.train.epochs,
                     cfg.train.batch_size, cfg.seed + target,
                     cache_key=("token", spec.use_routing, spec.dropout),
                     checkpoints=scoped(checkpoints, f"layer{target}"))
        nets[target] = jax.tree_util.tree_map(np.asarray, result.params)
        losses[target] = result.epoch_loss
    pred = TokenPredictor(name or cfg.name, cfg, trace.num_layers, E, trace.meta.top_k, table, nets)
    return pred, losses
