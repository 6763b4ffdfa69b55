"""Shared Flax NNX layers: norms, linear maps, SwiGLU MLPs, grouped-query attention with a KV cache.

Weights are stored as checkpoints store them, [out, in] (y = x W^T, torch's and HF's layout), so a
checkpoint loads without a transpose and the host expert store can view its files directly. Every
product with a weight goes through `linear` / `swiglu`: on the CPU a bf16 weight is multiplied by
moescope's native kernels (`models.native`; XLA:CPU converts a bf16 weight to f32 on every call),
elsewhere by XLA's own dot.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from models import native
from models.config import ModelConfig, NormKind, QKNorm
from models.rope import RopeTables, apply_rope

NEG_INF = -1e30


class AbstractRngs:
    """Stands in for `nnx.Rngs` to build a model whose parameters are `jax.ShapeDtypeStruct`s.

    Faster than `nnx.eval_shape` for models with thousands of expert arrays (each `rngs.params()`
    call under tracing costs time linear in the trace so far) and allocates nothing.
    """


def _init(rngs: nnx.Rngs | AbstractRngs, shape: tuple[int, ...], dtype: jnp.dtype, std: float = 0.02
          ) -> jax.Array | jax.ShapeDtypeStruct:
    if isinstance(rngs, AbstractRngs):
        return jax.ShapeDtypeStruct(shape, dtype)
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., K] times weight [N, K] transposed -> [..., N] in x's dtype (accumulated in f32 for bf16)."""
    if weight.dtype == jnp.bfloat16:
        return native.linear(x.astype(jnp.bfloat16), weight).astype(x.dtype)
    return jax.lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())))


class Linear(nnx.Module):
    """y = x @ weight^T (+ bias). weight: [out, in]."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.weight = nnx.Param(_init(rngs, (d_out, d_in), dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = linear(x, self.weight[...])
        return y + self.bias[...] if self.bias is not None else y


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype = jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype = jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def make_norm(cfg: ModelConfig, dim: int, dtype: jnp.dtype) -> nnx.Module:
    return LayerNorm(dim, cfg.rms_norm_eps, dtype) if cfg.norm is NormKind.layernorm else RMSNorm(dim, cfg.rms_norm_eps, dtype)


def swiglu(x: jax.Array, gate_up: jax.Array, down: jax.Array, out_dtype: Optional[jnp.dtype] = None) -> jax.Array:
    """SwiGLU MLP: x [T, H], gate|up rows [2F, H] (gate first), down [H, F] -> [T, H] in `out_dtype`
    (default x's). With bf16 weights the down projection is accumulated in f32 and returned unrounded
    when `out_dtype` is f32 (the experts' weighted sum rounds once, after adding every expert)."""
    out_dtype = out_dtype or x.dtype
    if gate_up.dtype == jnp.bfloat16:
        return native.swiglu(x.astype(jnp.bfloat16), gate_up, down).astype(out_dtype)
    h = linear(x, gate_up)
    f = down.shape[1]
    return linear(jax.nn.silu(h[..., :f]) * h[..., f:], down).astype(out_dtype)


class SwiGLU(nnx.Module):
    """Dense SwiGLU MLP (also one shared expert group of DeepSeek): gate|up [2I, H], down [H, I]."""

    def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.gate_up = nnx.Param(_init(rngs, (2 * intermediate, hidden), dtype))
        self.down = nnx.Param(_init(rngs, (hidden, intermediate), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return swiglu(x, self.gate_up[...], self.down[...])


# ---- attention --------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionInputs:
    """Per-forward attention context shared by every layer (built once by the transformer).

    positions [B, S]: positions of the S new tokens; write_index: scalar cache slot where they
    start; valid [B, C]: cache slots holding real tokens after this write; slot_positions [B, C]:
    the position of the token in each slot; cos/sin: {rot_dim: [B, S, rot_dim/2]}; total_len:
    scalar, the longest sequence after this forward (selects longrope tables); empty_cache (static): the cache held
    nothing before this forward (a prefill into a fresh cache), so attention reads the new tokens only.
    """

    positions: jax.Array
    write_index: jax.Array
    valid: jax.Array
    slot_positions: jax.Array
    cos: dict
    sin: dict
    total_len: jax.Array
    empty_cache: bool = dataclasses.field(default=False, metadata=dict(static=True))


def attention_masks(ai: AttentionInputs, sliding_window: Optional[int]) -> tuple[jax.Array, jax.Array]:
    """(bool [B, S, C], bool [B, S, S]): query s may attend cache slot c (written by an earlier forward),
    new token j (of this forward)."""
    S = ai.positions.shape[1]
    q_pos = ai.positions[:, :, None]
    earlier = jnp.arange(ai.valid.shape[1]) < ai.write_index
    k_pos = ai.slot_positions[:, None, :]
    cached = (ai.valid & earlier[None, :])[:, None, :] & (k_pos <= q_pos)
    n_pos = ai.positions[:, None, :]
    new = jax.lax.dynamic_slice_in_dim(ai.valid, ai.write_index, S, axis=1)[:, None, :] & (n_pos <= q_pos)
    if sliding_window is not None:
        cached = cached & (q_pos - k_pos < sliding_window)
        new = new & (q_pos - n_pos < sliding_window)
    return cached, new


def split_softmax(scores_cache: jax.Array, scores_new: jax.Array, masks: tuple[jax.Array, jax.Array]
                  ) -> tuple[jax.Array, jax.Array]:
    """Softmax over the keys [cache slots | new tokens] of two float32 score blocks, returned as the two
    probability blocks (no concatenated copy); `masks` broadcast against their blocks."""
    sc = jnp.where(masks[0], scores_cache, NEG_INF)
    sn = jnp.where(masks[1], scores_new, NEG_INF)
    top = jnp.maximum(jnp.max(sc, axis=-1, keepdims=True), jnp.max(sn, axis=-1, keepdims=True))
    ec, en = jnp.exp(sc - top), jnp.exp(sn - top)
    total = jnp.sum(ec, axis=-1, keepdims=True) + jnp.sum(en, axis=-1, keepdims=True)
    return ec / total, en / total


def new_softmax(scores_new: jax.Array, mask: jax.Array) -> jax.Array:
    """`split_softmax`'s new-token block when every cache slot is masked: each masked score is NEG_INF, whose exp
    after subtracting a row maximum of a real key is exactly 0, so the two are equal (up to XLA's order of the sum)
    on every row that has a key (a row without one, a padding query whose output is discarded, is uniform over fewer
    keys)."""
    sn = jnp.where(mask, scores_new, NEG_INF)
    top = jnp.max(sn, axis=-1, keepdims=True)
    en = jnp.exp(sn - top)
    return en / jnp.sum(en, axis=-1, keepdims=True)


def after(x: jax.Array, value: jax.Array) -> jax.Array:
    """`value`, made data-dependent on `x` (adds 0 * one element of x).

    A cache update that depends on the attention output is ordered after every read of the old
    cache, which lets XLA update the cache buffer in place inside the decode loop instead of copying
    every layer's cache each step (XLA:CPU's copy insertion cannot order independent ops).
    """
    return value + (x.reshape(-1)[0] * 0).astype(value.dtype)


def sdpa(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_new: jax.Array, v_new: jax.Array,
         masks: tuple[jax.Array, jax.Array], scale: float, empty_cache: bool = False) -> jax.Array:
    """Attention of S queries over the cache and the S new keys, GQA by grouping.

    q [B, S, Hq, D]; k_cache, v_cache [B, Hkv, C, D(v)]; k_new, v_new [B, S, Hkv, D(v)];
    masks ([B, S, C], [B, S, S]) from `attention_masks` -> [B, S, Hq, Dv]. `empty_cache`: no cache slot holds a
    token yet (every one masked), so the cache's scores, probabilities and product are left out: the same values for
    every query with a key (a masked slot's probability is exactly 0 and adds 0; XLA may order the remaining sums
    differently: bit for bit in bf16 in the tests, up to ~4e-6 apart in float32 logits on mixtral_tiny, which is why
    the offload executor's prefill takes this path too), a prefill's attention without its
    [S, C] score blocks (256 tokens of Mixtral: half the attention's dot work, 15 MB of XLA temp per layer).
    """
    B, S, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    r = Hq // Hkv
    qg = q.reshape(B, S, Hkv, r, D).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, r * S, D)
    kn, vn = k_new.transpose(0, 2, 1, 3).astype(k_cache.dtype), v_new.transpose(0, 2, 1, 3).astype(v_cache.dtype)
    f32 = jnp.float32
    sn = jnp.einsum("bgqd,bgcd->bgqc", qg, kn, preferred_element_type=f32).reshape(B, Hkv, r, S, S)
    if empty_cache:
        pn = new_softmax(sn * scale, masks[1][:, None, None])
        out = jnp.einsum("bgqc,bgcd->bgqd", pn.astype(v_cache.dtype).reshape(B, Hkv, r * S, S), vn)
        return out.reshape(B, Hkv, r, S, -1).transpose(0, 3, 1, 2, 4).reshape(B, S, Hq, -1)
    sc = jnp.einsum("bgqd,bgcd->bgqc", qg, k_cache, preferred_element_type=f32).reshape(B, Hkv, r, S, -1)
    pc, pn = split_softmax(sc * scale, sn * scale, (masks[0][:, None, None], masks[1][:, None, None]))
    out = (jnp.einsum("bgqc,bgcd->bgqd", pc.astype(v_cache.dtype).reshape(B, Hkv, r * S, -1), v_cache)
           + jnp.einsum("bgqc,bgcd->bgqd", pn.astype(v_cache.dtype).reshape(B, Hkv, r * S, S), vn))
    return out.reshape(B, Hkv, r, S, -1).transpose(0, 3, 1, 2, 4).reshape(B, S, Hq, -1)


def write_cache(cache: jax.Array, new: jax.Array, write_index: jax.Array) -> jax.Array:
    """cache [B, Hkv, C, D] <- new [B, S, Hkv, D] at slots [write_index, write_index + S)."""
    return jax.lax.dynamic_update_slice(cache, new.transpose(0, 2, 1, 3).astype(cache.dtype),
                                        (0, 0, write_index, 0))


class Attention(nnx.Module):
    """Grouped-query attention with optional q/k norms (Qwen3 per head, OLMoE full), biases, clipping."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.cfg = cfg
        d = cfg.attn_head_dim
        self.n_q, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.qkv = Linear(cfg.hidden_size, (self.n_q + 2 * self.n_kv) * d, bias=cfg.attention_bias, rngs=rngs, dtype=dtype)
        self.o = Linear(self.n_q * d, cfg.hidden_size, bias=cfg.attention_bias, rngs=rngs, dtype=dtype)
        if cfg.qk_norm is QKNorm.per_head:
            self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype), RMSNorm(d, cfg.rms_norm_eps, dtype)
        elif cfg.qk_norm is QKNorm.full:
            self.q_norm = RMSNorm(self.n_q * d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.n_kv * d, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.scale = d ** -0.5

    @property
    def rot_dim(self) -> int:
        return self.head_dim

    def cache_shape(self, batch: int, length: int) -> dict[str, tuple[int, ...]]:
        return {"k": (batch, self.n_kv, length, self.head_dim), "v": (batch, self.n_kv, length, self.head_dim)}

    def __call__(self, x: jax.Array, ai: AttentionInputs, cache: dict, rope: RopeTables
                 ) -> tuple[jax.Array, dict]:
        B, S, _ = x.shape
        d, nq, nkv = self.head_dim, self.n_q, self.n_kv
        qkv = self.qkv(x)
        q, k, v = qkv[..., : nq * d], qkv[..., nq * d: (nq + nkv) * d], qkv[..., (nq + nkv) * d:]
        if self.cfg.qk_norm is QKNorm.full:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cfg.clip_qkv is not None:
            c = self.cfg.clip_qkv
            q, k, v = jnp.clip(q, -c, c), jnp.clip(k, -c, c), jnp.clip(v, -c, c)
        q, k, v = q.reshape(B, S, nq, d), k.reshape(B, S, nkv, d), v.reshape(B, S, nkv, d)
        if self.cfg.qk_norm is QKNorm.per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = ai.cos[d], ai.sin[d]
        q = apply_rope(q, cos, sin, rope.interleave)
        k = apply_rope(k, cos, sin, rope.interleave)
        out = sdpa(q, cache["k"], cache["v"], k, v, attention_masks(ai, self.cfg.sliding_window), self.scale,
                   ai.empty_cache)
        ck = write_cache(cache["k"], after(out, k), ai.write_index)
        cv = write_cache(cache["v"], after(out, v), ai.write_index)
        return self.o(out.reshape(B, S, nq * d)), {"k": ck, "v": cv}
