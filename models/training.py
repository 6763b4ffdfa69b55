"""Pre-training pieces: a differentiable capacity-dispatch expert executor, the loss, the optax step.

Inference executors compute every routed (token, expert) pair exactly; for training we use the
usual capacity dispatch (GShard / Switch): each expert takes at most C = ceil(factor * T * k / E)
of the (token, slot) pairs in token order, the rest are dropped for that step (their residual
passes through). Everything is a dense, reverse-differentiable array program.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.moe import RoutedExperts, Routing
from models.transformer import MoETransformer, forward, init_cache


class CapacityExperts:
    """Training-time `ExpertExecutor`: experts stacked per step, pairs dispatched to [E, C, H] buffers."""

    def __init__(self, capacity_factor: float = 2.0):
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
        self.capacity_factor = capacity_factor

    def __hash__(self) -> int:
        return hash((type(self), self.capacity_factor))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CapacityExperts) and other.capacity_factor == self.capacity_factor

    def __call__(self, layer: int, x: jax.Array, routing: Routing, experts: Optional[RoutedExperts]) -> jax.Array:
        """x [T, H] -> [T, H]; pairs beyond an expert's capacity contribute nothing."""
        assert experts is not None
        T, k = routing.experts.shape
        E, H = experts.num_experts, x.shape[-1]
        C = min(T, max(1, math.ceil(self.capacity_factor * T * k / E)))
        flat_e = routing.experts.reshape(-1)
        live = jnp.ones_like(flat_e, bool) if routing.valid is None else jnp.repeat(routing.valid, k)
        onehot = jax.nn.one_hot(flat_e, E, dtype=jnp.int32) * live[:, None]
        position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
        keep = live & (position < C)
        slot = jnp.where(keep, flat_e * C + position, E * C)  # E * C: out of range, dropped
        token = jnp.arange(T * k) // k
        buffers = jnp.zeros((E * C, H), x.dtype).at[slot].set(x[token], mode="drop").reshape(E, C, H)
        gate_up, down = experts.arrays()
        F = down[0].shape[1]  # gate|up [2F, H], down [H, F] per expert
        h = jnp.einsum("ech,efh->ecf", buffers, jnp.stack(gate_up))
        y = jnp.einsum("ecf,ehf->ech", jax.nn.silu(h[..., :F]) * h[..., F:], jnp.stack(down)).reshape(E * C, H)
        pair_out = y[jnp.minimum(slot, E * C - 1)] * (routing.weights.reshape(-1) * keep)[:, None].astype(y.dtype)
        return pair_out.reshape(T, k, H).sum(axis=1).astype(x.dtype)


def load_balance_loss(router_logits: jax.Array, experts: jax.Array, num_experts: int) -> jax.Array:
    """Switch-Transformer auxiliary loss E * sum_e f_e * P_e, averaged over MoE layers.

    router_logits float32 [L, N, E]; experts int [L, N, k]. f_e: fraction of routed pairs that chose
    expert e; P_e: mean router probability of e. Equals 1 under perfect balance.
    """
    probs = jax.nn.softmax(router_logits, axis=-1).mean(axis=1)  # [L, E]
    counts = jax.nn.one_hot(experts, num_experts).sum(axis=(1, 2))  # [L, E]
    frac = counts / jnp.sum(counts, axis=-1, keepdims=True)
    return num_experts * jnp.mean(jnp.sum(frac * probs, axis=-1))


@dataclass(frozen=True)
class LossConfig:
    aux_loss_coef: float = 0.0
    capacity_factor: float = 2.0


def lm_loss(model: MoETransformer, tokens: jax.Array, cfg: LossConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy of packed sequences tokens int32 [B, S + 1] (+ aux balance loss)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    B, S = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    logits, _, captured = forward(model, inputs, init_cache(model, B, S, model.run_dtype), positions,
                                  executor=CapacityExperts(cfg.capacity_factor), capture=True, capture_logits=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    metrics = {"ce": ce}
    loss = ce
    if captured is not None:
        L = captured.experts.shape[0]
        aux = load_balance_loss(captured.logits.reshape(L, B * S, -1),
                                captured.experts.reshape(L, B * S, -1), model.cfg.num_experts)
        metrics["aux"] = aux
        loss = loss + cfg.aux_loss_coef * aux
    return loss, metrics


def make_optimizer(schedule: optax.ScalarOrSchedule, weight_decay: float, clip_norm: float,
                   b2: float = 0.999) -> optax.GradientTransformation:
    """AdamW after global-norm clipping: the one optimizer of the project's training loops (the language models with
    `lm_schedule` and b2 = 0.95, the predictors with `predictors.fitting.lr_schedule`)."""
    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=b2, weight_decay=weight_decay))


def lm_schedule(lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> optax.Schedule:
    """Linear warmup from 0, then cosine decay to `min_lr_ratio * lr` (counted in steps)."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, max(total_steps, warmup_steps + 1),
                                              end_value=lr * min_lr_ratio)


def make_train_step(loss_cfg: LossConfig) -> Any:
    """A jitted step (graphdef, params, opt_state, tokens) -> (params, opt_state, metrics)."""

    def step(graphdef: Any, params: Any, rest: Any, opt_state: Any, tokens: jax.Array, tx: Any) -> tuple:
        def loss_fn(p: Any) -> tuple[jax.Array, dict]:
            return lm_loss(nnx.merge(graphdef, p, rest), tokens, loss_cfg)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads)}
        return params, opt_state, metrics

    return jax.jit(step, static_argnames=("graphdef", "tx"), donate_argnames=("params", "opt_state"))


def make_eval_step(loss_cfg: LossConfig) -> Any:
    def evaluate(graphdef: Any, params: Any, rest: Any, tokens: jax.Array) -> dict[str, jax.Array]:
        return lm_loss(nnx.merge(graphdef, params, rest), tokens, loss_cfg)[1]

    return jax.jit(evaluate, static_argnames=("graphdef",))
