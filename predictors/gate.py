"""The gate-based predictor (Fate / HybriMoE / mixtral-offloading): a copy of MoE layer l+d's router
applied to layer l's gate input, routed exactly as the model family routes (`models.moe.route`).

Scores: the router's expert probabilities, plus 2 on the experts the family's top-k rule picks
(so the top-k of the scores is the routing itself, also for group-limited or biased top-k).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, ScoringFunc, TopkMethod
from models.moe import route
from predictors.base import LayerContext
from predictors.common import TrainedPredictor, pad_rows, row_bucket
from predictors.nets import host_sigmoid, one_blas_thread


# model -> its router copies: the predictors of every distance share one float32 copy per layer (at Qwen3-30B-A3B's
# full depth one set is 50 MB of anonymous memory)
_COPIES: "weakref.WeakKeyDictionary[Any, tuple[list[np.ndarray], list[np.ndarray]]]" = weakref.WeakKeyDictionary()


def gate_copies(model: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per MoE layer of an `MoETransformer`: router kernel float32 [H, E] and bias float32 [E] (zeros if none),
    read-only, made once per model."""
    try:
        return _COPIES[model]
    except (KeyError, TypeError):
        pass
    copies = read_gate_copies(model)
    for array in (*copies[0], *copies[1]):
        array.setflags(write=False)
    try:
        _COPIES[model] = copies
    except TypeError:  # a model that takes no weak reference: copied at each call
        pass
    return copies


def read_gate_copies(model: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`gate_copies` read from the model's routers."""
    kernels, biases = [], []
    for layer in model.layers:
        if not layer.is_moe:
            continue
        router = layer.moe.router
        kernel = np.ascontiguousarray(np.asarray(router.weight[...], np.float32).T)  # the model keeps [E, H]
        kernels.append(kernel)
        biases.append(np.zeros(kernel.shape[1], np.float32) if router.bias is None
                      else np.asarray(router.bias[...], np.float32))
    if not kernels:
        raise ValueError("gate copies: the model has no MoE layer")
    return kernels, biases


def router_probs(cfg: ModelConfig, logits: jax.Array) -> jax.Array:
    """The family's per-expert routing probabilities (sigmoid for DeepSeek-V3 style, softmax otherwise)."""
    return jax.nn.sigmoid(logits) if cfg.scoring_func is ScoringFunc.sigmoid else jax.nn.softmax(logits, axis=-1)


def gate_scores_fn(cfg: ModelConfig, hidden: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    """hidden [T, H] @ kernel [H, E] routed by `cfg`'s rule -> scores float32 [T, E] (routed experts + 2)."""
    logits = hidden.astype(jnp.float32) @ kernel
    routed = route(cfg, logits, bias)
    picked = jnp.zeros_like(logits).at[jnp.arange(logits.shape[0])[:, None], routed.experts].set(2.0)
    return router_probs(cfg, logits) + picked


@functools.lru_cache(maxsize=None)
def compiled_gate_scores(cfg: ModelConfig) -> Callable:
    return jax.jit(functools.partial(gate_scores_fn, cfg))


def host_routable(cfg: ModelConfig) -> bool:
    """Whether `gate_scores_host` reproduces the family's routing: plain top-k of softmax or sigmoid scores."""
    return cfg.topk_method is TopkMethod.greedy and cfg.scoring_func in (ScoringFunc.softmax, ScoringFunc.sigmoid)


@one_blas_thread
def gate_scores_host(cfg: ModelConfig, hidden: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """`gate_scores_fn` in numpy for `host_routable` families: [T, H] -> float32 [T, E]. A forecast in the
    middle of serving then waits for no device call (a small matmul on the host is far quicker than a call)."""
    logits = hidden.astype(np.float32) @ kernel
    if cfg.scoring_func is ScoringFunc.sigmoid:
        probs = host_sigmoid(logits)
    else:
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = e / e.sum(axis=-1, keepdims=True)
    k = cfg.num_experts_per_tok
    picked = np.argpartition(-probs, k - 1, axis=-1)[:, :k]
    probs[np.arange(probs.shape[0])[:, None], picked] += 2.0
    return probs


class GatePredictor(TrainedPredictor):
    kind = "gate"

    def __init__(self, name: str, distance: int, model_cfg: ModelConfig, kernels: dict[int, np.ndarray],
                 biases: dict[int, np.ndarray]):
        """kernels / biases: per target layer j, the router copy [H, E] / [E] applied to layer j - distance."""
        super().__init__(name, distance, len(model_cfg.moe_layers), model_cfg.num_experts,
                         model_cfg.num_experts_per_tok)
        missing = sorted(set(self.targets) - set(kernels))
        if missing:
            raise ValueError(f"{name}: no router copy for target layers {missing}")
        self.model_cfg = model_cfg
        self.host_kernels = {t: np.asarray(kernels[t], np.float32) for t in self.targets}
        self.host_biases = {t: np.asarray(biases[t], np.float32) for t in self.targets}
        self._scores = compiled_gate_scores(model_cfg)
        self._host = self.host_kernels if host_routable(model_cfg) else None
        self._device: Optional[tuple[dict[int, jax.Array], dict[int, jax.Array]]] = None

    def device_arrays(self) -> tuple[dict[int, jax.Array], dict[int, jax.Array]]:
        """(kernels, biases) per target as device arrays, made on first use: a host-routable family's forecasts never
        read them (at Qwen3-30B-A3B's full depth they were another 50 MB of buffers per distance)."""
        if self._device is None:
            self._device = ({t: jnp.asarray(k, jnp.float32) for t, k in self.host_kernels.items()},
                            {t: jnp.asarray(b, jnp.float32) for t, b in self.host_biases.items()})
        return self._device

    @property
    def kernels(self) -> dict[int, jax.Array]:
        return self.device_arrays()[0]

    @property
    def biases(self) -> dict[int, jax.Array]:
        return self.device_arrays()[1]

    @classmethod
    def from_model(cls, model: Any, distance: int = 1, name: Optional[str] = None) -> "GatePredictor":
        """Raw copies of the model's routers (no training)."""
        kernels, biases = gate_copies(model)
        L = len(kernels)
        return cls(name or f"gate@d{distance}", distance, model.cfg, {j: kernels[j] for j in range(distance, L)},
                   {j: biases[j] for j in range(distance, L)})

    def scores(self, target: int, ctx: LayerContext) -> np.ndarray:
        hidden = self.require_hidden(ctx)
        if self._host is not None:
            return gate_scores_host(self.model_cfg, hidden, self._host[target])
        n = hidden.shape[0]
        out = self._scores(pad_rows(hidden, row_bucket(n)), self.kernels[target], self.biases[target])
        return np.asarray(out)[:n]

    def layer_arrays(self) -> dict[int, Any]:
        return {t: {"kernel": self.host_kernels[t], "bias": self.host_biases[t]} for t in self.targets}
