"""The jitted pieces the offload executor calls layer by layer.

Sub-modules of the same kind share one NNX graphdef across layers (every layer's attention, every
router, every SwiGLU of the same width), so each piece compiles once per input shape, not once per
layer; graphdefs are static arguments, parameter states are traced. Device experts index the
cache's slot list: a pair whose slot index is -1 (a CPU expert, a padding row, an expert computed
elsewhere) carries weight 0 and contributes nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.moe import DEFAULT_EXECUTOR, ExpertExecutor, Routing
from models.transformer import KVCache, MoETransformer, attention_inputs, model_rope


class SlotExperts:
    """Duck-typed `RoutedExperts` over cache slots, for the model's expert executors."""

    def __init__(self, gate_up: list[jax.Array], down: list[jax.Array]):
        self.gate_up, self.down = gate_up, down

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def arrays(self) -> tuple[list[jax.Array], list[jax.Array]]:
        return self.gate_up, self.down


class _Head(nnx.Module):
    """Final norm + LM head of a model as one module (sharing the model's parameters)."""

    def __init__(self, model: MoETransformer):
        self.norm = model.norm
        self.lm_head = model.lm_head
        self.embed = model.embed if model.lm_head is None else None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm(x)
        out = h @ self.embed[...].T if self.lm_head is None else self.lm_head(h)
        return out.astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _prepare(cfg: ModelConfig, cache: KVCache, positions: jax.Array, valid: jax.Array) -> tuple[Any, KVCache]:
    return attention_inputs(cfg, cache, positions, valid)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _attention(cfg: ModelConfig, defs: tuple, states: tuple, x: jax.Array, ai: Any, layer_cache: dict
               ) -> tuple[jax.Array, dict, jax.Array]:
    n_in, attn, n_post = (nnx.merge(d, s) for d, s in zip(defs, states))
    h, layer_cache = attn(n_in(x), ai, layer_cache, model_rope(cfg))
    x = x + h
    return x, layer_cache, n_post(x)


@functools.partial(jax.jit, static_argnums=0)
def _route(gd: Any, state: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    B, S, H = g.shape
    r = nnx.merge(gd, state)(g.reshape(B * S, H))
    return r.experts, r.weights


@functools.partial(jax.jit, static_argnums=0)
def _dense(gd: Any, state: Any, x: jax.Array, g: jax.Array) -> jax.Array:
    return x + nnx.merge(gd, state)(g)


@functools.partial(jax.jit, static_argnums=0)
def _experts(executor: ExpertExecutor, g: jax.Array, slot_idx: jax.Array, weights: jax.Array, gate_up: list,
             down: list) -> jax.Array:
    B, S, H = g.shape
    live = slot_idx >= 0
    routing = Routing(experts=jnp.where(live, slot_idx, 0).astype(jnp.int32),
                      weights=jnp.where(live, weights, 0.0).astype(jnp.float32),
                      logits=jnp.zeros((B * S, 1), jnp.float32))
    return executor(-1, g.reshape(B * S, H), routing, SlotExperts(gate_up, down)).astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _combine(gd: Any, shared: Any, x: jax.Array, g: jax.Array, parts: list) -> jax.Array:
    B, S, H = x.shape
    y = parts[0]
    for p in parts[1:]:
        y = y + p
    y = y.reshape(B, S, H)
    if gd is not None:
        y = y + nnx.merge(gd, shared)(g).astype(jnp.float32)
    return x + y.astype(x.dtype)


@functools.partial(jax.jit, static_argnums=0)
def _head(gd: Any, state: Any, x_last: jax.Array) -> jax.Array:
    return nnx.merge(gd, state)(x_last)


@jax.jit
def _embed(embed: jax.Array, tokens: jax.Array) -> jax.Array:
    return embed[tokens]


class LayerKernels:
    """The per-layer calls of one model: attention (+ post-norm), router, dense MLP, device experts,
    combine (residual + shared experts), LM head. Compiled functions are shared by every instance."""

    def __init__(self, model: MoETransformer, expert_executor: ExpertExecutor = DEFAULT_EXECUTOR):
        self.cfg = model.cfg
        self.expert_executor = expert_executor
        split = nnx.split
        self.attn_states = [tuple(split(m)[1] for m in (l.input_norm, l.attn, l.post_norm)) for l in model.layers]
        first = model.layers[0]
        self.attn_defs = tuple(split(m)[0] for m in (first.input_norm, first.attn, first.post_norm))
        moe_layers = [l for l in model.layers if l.is_moe]
        dense_layers = [l for l in model.layers if not l.is_moe]
        self.router_def = split(moe_layers[0].moe.router)[0] if moe_layers else None
        self.router_states = {l.index: split(l.moe.router)[1] for l in moe_layers}
        shared = [l for l in moe_layers if l.moe.shared is not None]
        self.shared_def = split(shared[0].moe.shared)[0] if shared else None
        self.shared_states = {l.index: split(l.moe.shared)[1] for l in shared}
        self.mlp_def = split(dense_layers[0].mlp)[0] if dense_layers else None
        self.mlp_states = {l.index: split(l.mlp)[1] for l in dense_layers}
        self.head_def, self.head_state = split(_Head(model))
        self.embed = model.embed[...]

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return _embed(self.embed, tokens)

    def prepare(self, cache: KVCache, positions: jax.Array, valid: jax.Array) -> tuple[Any, KVCache]:
        return _prepare(self.cfg, cache, positions, valid)

    def attention(self, layer: int, x: jax.Array, ai: Any, layer_cache: dict) -> tuple[jax.Array, dict, jax.Array]:
        return _attention(self.cfg, self.attn_defs, self.attn_states[layer], x, ai, layer_cache)

    def route(self, layer: int, g: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _route(self.router_def, self.router_states[layer], g)

    def dense(self, layer: int, x: jax.Array, g: jax.Array) -> jax.Array:
        return _dense(self.mlp_def, self.mlp_states[layer], x, g)

    def experts(self, g: jax.Array, slot_idx: Any, weights: Any, gate_up: list, down: list) -> jax.Array:
        return _experts(self.expert_executor, g, slot_idx, weights, gate_up, down)

    def combine(self, layer: int, x: jax.Array, g: jax.Array, parts: list) -> jax.Array:
        shared = self.shared_states.get(layer)
        return _combine(self.shared_def if shared is not None else None, shared, x, g, parts)

    def logits(self, x_last: jax.Array) -> jax.Array:
        return _head(self.head_def, self.head_state, x_last)
