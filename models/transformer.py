"""The decoder-only MoE transformer shared by every family, its KV cache and its forward pass.

Families differ only in configuration (`ModelConfig`) and HF naming (`models/<family>.py`); the
module tree is the same: embed -> N x DecoderLayer -> norm -> lm_head. A decoder layer is
pre-norm attention (GQA or MLA) and a pre-norm feed-forward that is a dense SwiGLU or a
`MoEBlock` (router + expert executor + optional shared experts).

`forward` is a pure function of the model (use it under `nnx.jit` or with split state) that
returns the logits, the updated cache and, on request, the routing of every MoE layer (the
capture hook): per MoE layer the experts, their weights and optionally the gate input.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import AbstractRngs, Attention, AttentionInputs, Linear, SwiGLU, _init, make_norm
from models.quant.dense import embed_lookup, tied_head
from models.mla import MLAttention
from models.moe import DEFAULT_EXECUTOR, ExpertExecutor, MoEBlock, Routing
from models.rope import RopeTables, cos_sin, rope_tables


EXACT_ROUNDING: dict[str, Any] = {"xla_allow_excess_precision": False}
"""Compile options of every program that runs the model. Each bf16 value is rounded where the model's
code rounds it, so a pass computes the same numbers whether it runs as one program (in-memory
generation) or as the offload executor's layer-by-layer calls; left to itself XLA keeps some values
in float32 inside a fused program and not across calls, which moved offloaded bf16 logits by about
as much as bf16 itself moves them from float32."""


@functools.lru_cache(maxsize=64)
def model_rope(cfg: ModelConfig) -> RopeTables:
    """The rotary tables of `cfg` (MLA rotates only qk_rope_head_dim dimensions)."""
    return rope_tables(cfg, cfg.qk_rope_head_dim if cfg.uses_mla else cfg.attn_head_dim)


# ---- cache ------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer attention caches plus the slot bookkeeping shared by all layers.

    layers: one dict per decoder layer ({"k", "v"} [B, Hkv, C, D] for GQA, {"ckv" [B, C, r],
    "kpe" [B, C, d_r]} for MLA); valid bool [B, C]: slot holds a real token; positions int32
    [B, C]: that token's position; index int32 []: the next free slot (all rows advance together;
    prompts are left-padded so they end on the same slot).
    """

    layers: list
    valid: jax.Array
    positions: jax.Array
    index: jax.Array

    @property
    def capacity(self) -> int:
        return int(self.valid.shape[1])


def init_cache(model: "MoETransformer", batch: int, length: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
    """An empty cache of `length` slots for `batch` rows."""
    layers = [{name: jnp.zeros(shape, dtype) for name, shape in layer.attn.cache_shape(batch, length).items()}
              for layer in model.layers]
    return KVCache(layers=layers, valid=jnp.zeros((batch, length), bool),
                   positions=jnp.zeros((batch, length), jnp.int32), index=jnp.zeros((), jnp.int32))


# ---- modules ------------------------------------------------------------------------------------


class DecoderLayer(nnx.Module):
    """Pre-norm attention + pre-norm feed-forward (dense SwiGLU or MoE), both residual."""

    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32,
                 with_experts: bool = True):
        self.index = index
        self.input_norm = make_norm(cfg, cfg.hidden_size, dtype)
        self.attn = MLAttention(cfg, rngs=rngs, dtype=dtype) if cfg.uses_mla else Attention(cfg, rngs=rngs, dtype=dtype)
        self.post_norm = make_norm(cfg, cfg.hidden_size, dtype)
        if cfg.is_moe_layer(index):
            self.moe = MoEBlock(cfg, rngs=rngs, dtype=dtype, with_experts=with_experts)
            self.mlp = None
        else:
            self.moe = None
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def attend(self, x: jax.Array, ai: AttentionInputs, cache: dict, rope: RopeTables) -> tuple[jax.Array, dict]:
        """x [B, S, H] -> x + attention(norm(x)), updated layer cache."""
        h, cache = self.attn(self.input_norm(x), ai, cache, rope)
        return x + h, cache

    def feed_forward(self, x: jax.Array, executor: ExpertExecutor, token_valid: jax.Array
                     ) -> tuple[jax.Array, Optional[Routing], jax.Array]:
        """x [B, S, H] -> (x + ffn(norm(x)), routing of the B*S tokens or None, gate input norm(x) [B, S, H])."""
        g = self.post_norm(x)
        B, S, H = g.shape
        if self.moe is None:
            return x + self.mlp(g), None, g
        y, routing = self.moe(self.index, g.reshape(B * S, H), executor, token_valid.reshape(B * S))
        return x + y.reshape(B, S, H), routing, g

    def __call__(self, x: jax.Array, ai: AttentionInputs, cache: dict, rope: RopeTables,
                 executor: ExpertExecutor, token_valid: jax.Array, last_rows: bool = False
                 ) -> tuple[jax.Array, dict, Optional[Routing], jax.Array]:
        """x [B, S, H] -> (output [B, S', H], cache, routing of the B*S' tokens or None, gate input [B, S', H]).

        S' is S, or 1 with `last_rows`: attention (and so the cache) covers all S tokens, the feed-forward only
        each row's last one (`forward`'s `last_only` at the last layer: the only rows whose logits are wanted)."""
        x, cache = self.attend(x, ai, cache, rope)
        if last_rows:
            x, token_valid = x[:, -1:], token_valid[:, -1:]
        x, routing, g = self.feed_forward(x, executor, token_valid)
        return x, cache, routing, g


class MoETransformer(nnx.Module):
    """A decoder-only MoE language model of any supported family."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32, with_experts: bool = True):
        self.cfg = cfg
        self.embed = nnx.Param(_init(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, dtype=dtype, with_experts=with_experts)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = make_norm(cfg, cfg.hidden_size, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else \
            Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.lm_head_bias, rngs=rngs, dtype=dtype)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.cfg.moe_layers

    @property
    def run_dtype(self) -> Any:
        """The dtype the model computes in (its final norm's: the embedding may be kept in uint8 blocks)."""
        return self.norm.weight[...].dtype

    def embedding(self) -> jax.Array:
        """The whole embedding table [V, H] in the run dtype (dequantized when kept in blocks)."""
        return self.embed_tokens(jnp.arange(self.cfg.vocab_size, dtype=jnp.int32))

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens int [...] -> embeddings [..., H] in the run dtype."""
        return embed_lookup(self.embed[...], tokens, self.run_dtype)

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: x [..., H] -> float32 logits [..., V]."""
        h = self.norm(x)
        out = tied_head(h, self.embed[...]) if self.lm_head is None else self.lm_head(h)
        return out.astype(jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Captured:
    """Routing of every MoE layer for one forward: experts int32 [L, B, S, k], weights float32
    [L, B, S, k], hidden (gate inputs) [L, B, S, H] or None, router logits float32 [L, B, S, E] or
    None. L counts MoE layers only."""

    experts: jax.Array
    weights: jax.Array
    hidden: Optional[jax.Array] = None
    logits: Optional[jax.Array] = None


def attention_inputs(cfg: ModelConfig, cache: KVCache, positions: jax.Array, token_valid: jax.Array,
                     empty_cache: bool = False) -> tuple[AttentionInputs, KVCache]:
    """Write the slot bookkeeping of S new tokens into `cache` and build the attention context (`empty_cache`: the
    caller knows the cache holds no token yet, see `AttentionInputs`)."""
    index = cache.index
    valid = jax.lax.dynamic_update_slice(cache.valid, token_valid, (0, index))
    slot_positions = jax.lax.dynamic_update_slice(cache.positions, positions.astype(jnp.int32), (0, index))
    total_len = jnp.max(jnp.where(token_valid, positions, 0)) + 1
    tables = model_rope(cfg)
    cos, sin = cos_sin(tables, positions, total_len)
    ai = AttentionInputs(positions=positions, write_index=index, valid=valid, slot_positions=slot_positions,
                         cos={tables.rot_dim: cos}, sin={tables.rot_dim: sin}, total_len=total_len,
                         empty_cache=empty_cache)
    cache = KVCache(layers=cache.layers, valid=valid, positions=slot_positions, index=index)
    return ai, cache


# ---- one trace per layer structure --------------------------------------------------------------------

SHARED_LAYER_INDEX = -1
"""The index a layer carries inside `shared_layer_call`'s trace (an executor that shares layers ignores it)."""


def shares_layers(executor: ExpertExecutor, x: jax.Array) -> bool:
    """Whether `forward` runs its layers through `shared_layer_call`: inside a trace (under a jit the nested calls
    are inlined; eager callers keep one call per op) and with an executor whose output does not depend on the
    layer index (`layer_free`)."""
    return isinstance(x, jax.core.Tracer) and bool(getattr(executor, "layer_free", False))


class SharedLayer(DecoderLayer):
    """A decoder layer's modules (the same objects) under `SHARED_LAYER_INDEX`: layers of one structure (module tree,
    parameter shapes and types) split into one graphdef, the key of one shared trace. A new object, so that nothing
    of the model is mutated inside a trace (NNX refuses that from an inner trace such as a scan's body)."""

    def __init__(self, layer: DecoderLayer):  # noqa: D107 - shares the modules; DecoderLayer.__init__ would build new ones
        self.index = SHARED_LAYER_INDEX
        self.input_norm, self.attn, self.post_norm = layer.input_norm, layer.attn, layer.post_norm
        self.moe, self.mlp = layer.moe, layer.mlp


def _layer_step(graphdef: Any, state: Any, x: jax.Array, ai: AttentionInputs, layer_cache: dict,
                token_valid: jax.Array, cfg: ModelConfig, executor: ExpertExecutor, last_rows: bool = False
                ) -> tuple[jax.Array, dict, Optional[Routing], jax.Array]:
    layer = nnx.merge(graphdef, state)
    return layer(x, ai, layer_cache, model_rope(cfg), executor, token_valid, last_rows)


_layer_step_jit = jax.jit(_layer_step, static_argnums=(0,), static_argnames=("cfg", "executor", "last_rows"))
"""Why a nested jit: the model's program used to unroll every layer's Python (the MoE block traces every
expert's branches), so its trace, lowering and compile grew with depth (a 48-layer Qwen3-30B-A3B took minutes
before its first token). Called inside the model's jit, this is traced and lowered once per layer structure
and called from each layer; XLA inlines the calls, so the numbers are the unrolled program's. A prefill's last layer
(`last_rows`) is one more trace of its structure."""


def shared_layer_call(layer: DecoderLayer, x: jax.Array, ai: AttentionInputs, layer_cache: dict,
                      token_valid: jax.Array, executor: ExpertExecutor, last_rows: bool = False
                      ) -> tuple[jax.Array, dict, Optional[Routing], jax.Array]:
    """`layer(x, ai, layer_cache, rope, executor, token_valid, last_rows)` through the trace its structure shares."""
    graphdef, state = nnx.split(SharedLayer(layer))
    return _layer_step_jit(graphdef, state, x, ai, layer_cache, token_valid, cfg=layer.attn.cfg, executor=executor,
                           last_rows=last_rows)


def trims_last_layer(last_only: bool, capture: bool, seq_len: int) -> bool:
    """Whether a pass runs its last decoder layer's feed-forward on each row's last token only (llama.cpp's "skip
    computing output for unused tokens"): only the last token's logits are wanted (`last_only`), more than one token
    per row, and no routing capture (that records every token's routing). The KV cache does not need the skipped rows:
    the last layer's keys and values come from its attention input. The offload executor follows the same rule, so
    its experts see the rows the in-memory model's do."""
    return last_only and not capture and seq_len > 1


def forward(model: MoETransformer, tokens: jax.Array, cache: KVCache, positions: jax.Array,
            token_valid: Optional[jax.Array] = None, *, executor: ExpertExecutor = DEFAULT_EXECUTOR,
            capture: bool = False, capture_hidden: bool = False, capture_logits: bool = False,
            last_only: bool = False, empty_cache: bool = False) -> tuple[jax.Array, KVCache, Optional[Captured]]:
    """Run S new tokens per row through the model.

    tokens, positions: int32 [B, S]; token_valid: bool [B, S] (False for padding; default all True).
    Returns logits float32 [B, S, V] ([B, V] with `last_only`), the cache advanced by S slots and,
    with `capture`, the routing of every MoE layer. With `last_only` (and no `capture`) the last decoder layer's
    feed-forward runs on each row's last token only (`trims_last_layer`; left padding puts every row's last token in
    the last column). `empty_cache`: the caller vouches that `cache` holds no token
    (a prefill into a fresh cache): attention then skips the cache's score blocks (`models.layers.sdpa`), the same
    values up to the order XLA sums them in (the offload executor's prefill does the same, so the two stay bit for bit).
    """
    cfg = model.cfg
    B, S = tokens.shape
    if token_valid is None:
        token_valid = jnp.ones((B, S), bool)
    ai, cache = attention_inputs(cfg, cache, positions, token_valid, empty_cache)
    rope = model_rope(cfg)
    x = model.embed_tokens(tokens)
    new_layers, experts, weights, hidden, router_logits = [], [], [], [], []
    shared = shares_layers(executor, x)
    trim = trims_last_layer(last_only, capture, S)
    for i, (layer, layer_cache) in enumerate(zip(model.layers, cache.layers)):
        last_rows = trim and i == len(model.layers) - 1  # x becomes [B, 1, H]: each row's last token
        if shared:
            x, layer_cache, routing, gate_in = shared_layer_call(layer, x, ai, layer_cache, token_valid, executor,
                                                                 last_rows)
        else:
            x, layer_cache, routing, gate_in = layer(x, ai, layer_cache, rope, executor, token_valid, last_rows)
        new_layers.append(layer_cache)
        if routing is not None and capture:
            k = routing.experts.shape[-1]
            experts.append(routing.experts.reshape(B, S, k))
            weights.append(routing.weights.reshape(B, S, k))
            if capture_hidden:
                hidden.append(gate_in)
            if capture_logits:
                router_logits.append(routing.logits.reshape(B, S, -1))
    out = KVCache(layers=new_layers, valid=cache.valid, positions=cache.positions, index=cache.index + S)
    logits = model.logits(x[:, -1] if last_only else x)
    captured = None
    if capture and experts:
        captured = Captured(experts=jnp.stack(experts), weights=jnp.stack(weights),
                            hidden=jnp.stack(hidden) if capture_hidden else None,
                            logits=jnp.stack(router_logits) if capture_logits else None)
    return logits, out, captured


def build_model(cfg: ModelConfig, *, seed: int = 0, dtype: jnp.dtype = jnp.float32, with_experts: bool = True
                ) -> MoETransformer:
    """A randomly initialised model (std 0.02 weights, unit norms)."""
    return MoETransformer(cfg, rngs=nnx.Rngs(params=seed), dtype=dtype, with_experts=with_experts)


def abstract_model(cfg: ModelConfig, dtype: jnp.dtype = jnp.float32, with_experts: bool = True) -> MoETransformer:
    """The model's structure with `jax.ShapeDtypeStruct` leaves: nothing is allocated."""
    return MoETransformer(cfg, rngs=AbstractRngs(), dtype=dtype, with_experts=with_experts)


def param_bytes(model: MoETransformer) -> int:
    """Bytes of the model's parameter arrays (routed experts included when it holds them)."""
    state = nnx.state(model, nnx.Param)
    return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state)))


def count_params(cfg: ModelConfig) -> int:
    """Total parameters of `cfg`'s model, counted on the abstract model (nothing allocated)."""
    state = nnx.state(abstract_model(cfg), nnx.Param)
    return int(sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(state)))


forward_jit = nnx.jit(forward, static_argnames=("executor", "capture", "capture_hidden", "capture_logits", "last_only",
                                                     "empty_cache"))
"""`forward` compiled once per input shape (the model passes as an NNX argument)."""


def rebuild(model: MoETransformer, dtype: jnp.dtype, with_experts: bool = True) -> MoETransformer:
    """A model of `model.cfg` whose parameters are `model`'s, in `dtype`: the same arrays where the dtype
    already matches (nothing copied), converted copies otherwise; routed experts left out unless `with_experts`
    (quantized experts, `models.quant.QuantExperts`, and dense projections kept in blocks,
    `models.quant.dense.QuantLinear`, are shared as they are)."""
    from models.quant.experts import QuantExperts

    quantized = {layer: model.layers[layer].moe.experts for layer in model.cfg.moe_layers
                 if isinstance(model.layers[layer].moe.experts, QuantExperts)}
    if quantized and with_experts:  # block experts are the same in any run dtype: shared, not converted
        out = rebuild(model, dtype, with_experts=False)
        for layer, experts in quantized.items():
            out.layers[layer].moe.experts = nnx.data(experts)
        return out
    from models.quant.dense import carry_dense

    target = abstract_model(model.cfg, dtype, with_experts=with_experts)
    carry_dense(model, target, dtype)  # dense projections kept in blocks: shared as they are
    graphdef, state = nnx.split(target)
    source = nnx.to_pure_dict(nnx.state(model))

    def fill(target: dict, src: dict) -> dict:
        return {k: fill(v, src[k]) if isinstance(v, dict) else jnp.asarray(src[k]).astype(v.dtype)
                for k, v in target.items()}

    nnx.replace_by_pure_dict(state, fill(nnx.to_pure_dict(state), source))
    return nnx.merge(graphdef, state)


def without_experts(model: MoETransformer) -> MoETransformer:
    """`model` without its routed experts, sharing every other array (the offload executor's model)."""
    return rebuild(model, model.run_dtype, with_experts=False)
