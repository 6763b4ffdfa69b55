"""Multi-head latent attention (DeepSeek-V2/V3, Moonlight), with the latent KV cache.

The cache holds the compressed latent c_kv [B, C, r] and the shared rotary key k_pe [B, C, d_r]
per layer, never per-head keys and values. Attention runs in the absorbed form: the key
up-projection is folded into the query (q_lat = q_nope @ W_uk^T) and the value up-projection is
applied after the weighted sum of latents, which is algebraically equal to expanding K and V.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig, RopeType
from models.layers import AttentionInputs, Linear, RMSNorm, after, attention_masks, split_softmax
from models.rope import RopeTables, apply_rope


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (as DeepSeek and HF do)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling
    if s is not None and s.type is RopeType.yarn and s.mscale_all_dim and s.factor > 1:
        m = 0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0
        scale = scale * m * m
    return scale


class MLAttention(nnx.Module):
    """DeepSeek MLA: optional q-LoRA (q_a -> norm -> q_b), kv_a -> (latent norm, rotary key), kv_b."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.cfg = cfg
        self.n_heads = cfg.num_attention_heads
        self.d_nope, self.d_rope, self.d_v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        q_out = self.n_heads * (self.d_nope + self.d_rope)
        if cfg.q_lora_rank is None:
            self.q = Linear(cfg.hidden_size, q_out, bias=False, rngs=rngs, dtype=dtype)
            self.q_a = self.q_a_norm = self.q_b = None
        else:
            self.q = None
            self.q_a = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias, rngs=rngs, dtype=dtype)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype)
            self.q_b = Linear(cfg.q_lora_rank, q_out, bias=False, rngs=rngs, dtype=dtype)
        self.kv_a = Linear(cfg.hidden_size, self.rank + self.d_rope, bias=cfg.attention_bias, rngs=rngs, dtype=dtype)
        self.kv_a_norm = RMSNorm(self.rank, 1e-6, dtype)
        self.kv_b = Linear(self.rank, self.n_heads * (self.d_nope + self.d_v), bias=False, rngs=rngs, dtype=dtype)
        self.o = Linear(self.n_heads * self.d_v, cfg.hidden_size, bias=cfg.attention_bias, rngs=rngs, dtype=dtype)
        self.scale = mla_softmax_scale(cfg)

    @property
    def rot_dim(self) -> int:
        return self.d_rope

    def cache_shape(self, batch: int, length: int) -> dict[str, tuple[int, ...]]:
        return {"ckv": (batch, length, self.rank), "kpe": (batch, length, self.d_rope)}

    def __call__(self, x: jax.Array, ai: AttentionInputs, cache: dict, rope: RopeTables) -> tuple[jax.Array, dict]:
        """x [B, S, H] -> ([B, S, H], updated cache)."""
        B, S, _ = x.shape
        nh, dn, dr = self.n_heads, self.d_nope, self.d_rope
        q = self.q(x) if self.q is not None else self.q_b(self.q_a_norm(self.q_a(x)))
        q = q.reshape(B, S, nh, dn + dr)
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        kv = self.kv_a(x)
        c_kv = self.kv_a_norm(kv[..., : self.rank])
        k_pe = kv[..., self.rank:].reshape(B, S, 1, dr)
        cos, sin = ai.cos[dr], ai.sin[dr]
        q_pe = apply_rope(q_pe, cos, sin, rope.interleave)
        k_pe = apply_rope(k_pe, cos, sin, rope.interleave)[:, :, 0]
        c_kv, k_pe = c_kv.astype(cache["ckv"].dtype), k_pe.astype(cache["kpe"].dtype)

        w_b = self.kv_b.weight[...].reshape(nh, dn + self.d_v, self.rank)  # [out, in] = [heads x (dn + dv), r]
        w_uk, w_uv = w_b[:, :dn], w_b[:, dn:]
        q_lat = jnp.einsum("bshd,hdr->bshr", q_nope, w_uk)
        f32 = jnp.float32
        # scores over the cached slots and over the S new tokens (read before the cache is written)
        sc = (jnp.einsum("bshr,bcr->bhsc", q_lat, cache["ckv"], preferred_element_type=f32)
              + jnp.einsum("bshd,bcd->bhsc", q_pe, cache["kpe"], preferred_element_type=f32)) * self.scale
        sn = (jnp.einsum("bshr,bcr->bhsc", q_lat, c_kv, preferred_element_type=f32)
              + jnp.einsum("bshd,bcd->bhsc", q_pe, k_pe, preferred_element_type=f32)) * self.scale
        mask_cache, mask_new = attention_masks(ai, self.cfg.sliding_window)
        pc, pn = split_softmax(sc, sn, (mask_cache[:, None], mask_new[:, None]))
        o_lat = (jnp.einsum("bhsc,bcr->bshr", pc.astype(c_kv.dtype), cache["ckv"])
                 + jnp.einsum("bhsc,bcr->bshr", pn.astype(c_kv.dtype), c_kv))
        out = jnp.einsum("bshr,hdr->bshd", o_lat, w_uv).reshape(B, S, nh * self.d_v)
        ckv_all = jax.lax.dynamic_update_slice(cache["ckv"], after(o_lat, c_kv), (0, ai.write_index, 0))
        kpe_all = jax.lax.dynamic_update_slice(cache["kpe"], after(o_lat, k_pe), (0, ai.write_index, 0))
        return self.o(out), {"ckv": ckv_all, "kpe": kpe_all}
