"""The small networks and losses of the learned predictors, as pure JAX functions over param dicts.

LLaPor (LayerScope §4.2.2, Fig. 8): features = [PCA(a) ; routing of layer l] ->
`blocks` x (Linear -> GELU -> Dropout) -> optional gated residual blocks (middle groups: a stack of
Linear -> GELU -> Dropout whose output is scaled by sigmoid(Linear(PCA(a))) before it is added) ->
Linear to one logit per expert of layer l + d. The token predictor is the same net with the token
embedding in place of PCA(a).

Params are plain nested dicts / lists of arrays, so optax updates and orbax saves them as pytrees.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from threadpoolctl import ThreadpoolController

Params = dict[str, Any]


def init_linear(rng: np.random.Generator, n_in: int, n_out: int) -> Params:
    """LeCun-normal weights [n_in, n_out], zero bias [n_out] (numpy: initialising compiles nothing)."""
    w = rng.standard_normal((n_in, n_out)) / math.sqrt(max(n_in, 1))
    return {"w": w.astype(np.float32), "b": np.zeros((n_out,), np.float32)}


def linear(p: Params, x: jax.Array) -> jax.Array:
    return x @ p["w"] + p["b"]


def _dropout(x: jax.Array, rate: float, key: Optional[jax.Array]) -> jax.Array:
    if key is None or rate <= 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def init_net(seed: int, feat_dim: int, gate_dim: int, num_out: int, width: int, blocks: int,
             residual_blocks: int = 0, residual_depth: int = 2) -> Params:
    """Parameters of the predictor net: feature dim -> `blocks` hidden blocks -> residual blocks -> logits."""
    if blocks < 1:
        raise ValueError(f"predictor net: blocks must be >= 1, got {blocks}")
    rng = np.random.default_rng(seed)
    params: Params = {"blocks": [init_linear(rng, feat_dim if i == 0 else width, width) for i in range(blocks)],
                      "residual": [], "out": None}
    for _ in range(residual_blocks):
        params["residual"].append({"layers": [init_linear(rng, width, width) for _ in range(residual_depth)],
                                   "gate": init_linear(rng, gate_dim, width)})
    params["out"] = init_linear(rng, width, num_out)
    return params


def host_gelu(x: np.ndarray) -> np.ndarray:
    """`jax.nn.gelu` (its default tanh approximation) in numpy."""
    cube = x * x * x  # x ** 3 goes through numpy's generic pow: 10x slower here
    return 0.5 * x * (1.0 + np.tanh(np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * cube)))


def host_sigmoid(x: np.ndarray) -> np.ndarray:
    """The logistic function in numpy, in its tanh form (no overflow for large |x|)."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


HOST_OPS = (host_gelu, host_sigmoid)  # (gelu, sigmoid) for inference in numpy, off the device's queue

F = TypeVar("F", bound=Callable[..., Any])


@functools.lru_cache(maxsize=1)
def _blas() -> ThreadpoolController:
    return ThreadpoolController()


def one_blas_thread(fn: F) -> F:
    """Run `fn`'s numpy matmuls on one BLAS thread. Host forecasts are a few small matmuls on the
    executor's critical path, next to the device's and torch's threads: OpenBLAS waking its pool for
    them made a LLaPor prefill forecast tens of times slower on a loaded small machine than on one
    thread (the limit itself costs little per call)."""

    @functools.wraps(fn)
    def limited(*args: Any, **kwargs: Any) -> Any:
        with _blas().limit(limits=1, user_api="blas"):
            return fn(*args, **kwargs)

    return limited  # type: ignore[return-value]


def apply_net(params: Params, feats: jax.Array, gate_feats: jax.Array, dropout: float = 0.0,
              key: Optional[jax.Array] = None, ops: tuple[Callable, Callable] = (jax.nn.gelu, jax.nn.sigmoid)
              ) -> jax.Array:
    """feats [T, F], gate_feats [T, G] (what modulates the residual blocks) -> logits [T, E].

    `key` None: inference (no dropout). `ops`: the (gelu, sigmoid) pair; `HOST_OPS` with numpy params
    and inputs runs the net in numpy (a forecast in the middle of serving then waits for no device call).
    """
    gelu, sigmoid = ops
    n_drop = len(params["blocks"]) + sum(len(r["layers"]) for r in params["residual"])
    keys = list(jax.random.split(key, n_drop)) if key is not None else [None] * n_drop
    h = feats
    for p in params["blocks"]:
        h = _dropout(gelu(linear(p, h)), dropout, keys.pop())
    for block in params["residual"]:
        r = h
        for p in block["layers"]:
            r = _dropout(gelu(linear(p, r)), dropout, keys.pop())
        h = h + sigmoid(linear(block["gate"], gate_feats)) * r
    return linear(params["out"], h)


def count_params(params: Any) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(params)))


def param_bytes(params: Any) -> int:
    return int(sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(params)))


# ---- losses -------------------------------------------------------------------------------------------
def _masked_mean(per_token: jax.Array, mask: Optional[jax.Array]) -> jax.Array:
    if mask is None:
        return jnp.mean(per_token)
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def bce_loss(logits: jax.Array, y: jax.Array, mask: Optional[jax.Array] = None) -> jax.Array:
    """Mean over tokens of the mean over experts of BCE(y_i, sigmoid(logit_i)). logits, y: [T, E]."""
    return _masked_mean(jnp.mean(optax.sigmoid_binary_cross_entropy(logits, y), axis=-1), mask)


def hybrid_loss(logits: jax.Array, y: jax.Array, inv_freq: jax.Array, lam: float, gamma: float,
                mask: Optional[jax.Array] = None) -> jax.Array:
    """LayerScope §4.2.3: L = L_expert + lambda * L_focal, averaged over tokens.

    L_expert = 1/N sum_i BCE(y_i, p_i) / f_i (inverse expert frequency), L_focal = 1/N sum_i
    (1 - p_t)^gamma BCE(y_i, p_i) with p_t = p_i where y_i = 1 and 1 - p_i otherwise; N experts,
    BCE the positive binary cross-entropy. inv_freq: [E] = 1 / f_i.
    """
    bce = optax.sigmoid_binary_cross_entropy(logits, y)  # [T, E]
    p = jax.nn.sigmoid(logits)
    p_t = y * p + (1.0 - y) * (1.0 - p)
    l_expert = jnp.mean(bce * inv_freq[None, :], axis=-1)
    l_focal = jnp.mean((1.0 - p_t) ** gamma * bce, axis=-1)
    return _masked_mean(l_expert + lam * l_focal, mask)


def soft_target_ce(logits: jax.Array, target: jax.Array, mask: Optional[jax.Array] = None) -> jax.Array:
    """Softmax cross-entropy against a target distribution [T, E] (rows sum to 1): the gate fine-tune loss."""
    return _masked_mean(optax.softmax_cross_entropy(logits, target), mask)
