"""Rotary position embeddings: inverse frequencies for every scaling variant, and their application.

The frequency tables are computed once in numpy from the config (they are constants of the
compiled program); cos/sin are computed from positions inside the jitted forward, so no table of
`max_position_embeddings` rows is ever materialised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, RopeScaling, RopeType


@dataclass(frozen=True)
class RopeTables:
    """inv_freq [rot_dim/2]; `long_inv_freq` replaces it when the sequence exceeds `switch_len`."""

    inv_freq: np.ndarray
    attention_factor: float = 1.0
    long_inv_freq: Optional[np.ndarray] = None
    long_attention_factor: Optional[float] = None
    switch_len: Optional[int] = None  # longrope: use long tables when max(position) + 1 > switch_len
    interleave: bool = False  # rotate (even, odd) pairs instead of (first half, second half)

    @property
    def rot_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    return (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(np.float32)


def _yarn(theta: float, dim: int, s: RopeScaling, max_pos: int) -> tuple[np.ndarray, float]:
    factor = s.factor
    orig = s.original_max_position_embeddings or max_pos

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        attention_factor = float(get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim))
    else:
        attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), attention_factor


def _llama3(theta: float, dim: int, s: RopeScaling) -> np.ndarray:
    inv = _base_inv_freq(theta, dim)
    orig = s.original_max_position_embeddings or 8192
    low_wavelen = orig / s.low_freq_factor
    high_wavelen = orig / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(cfg: ModelConfig, rot_dim: Optional[int] = None) -> RopeTables:
    """Frequencies for `cfg` (rot_dim defaults to the attention head dim; MLA passes qk_rope_head_dim)."""
    dim = rot_dim if rot_dim is not None else cfg.attn_head_dim
    s = cfg.rope_scaling
    if s is None or s.type is RopeType.default:
        return RopeTables(_base_inv_freq(cfg.rope_theta, dim), interleave=cfg.rope_interleave)
    if s.type is RopeType.yarn:
        inv, att = _yarn(cfg.rope_theta, dim, s, cfg.max_position_embeddings)
        return RopeTables(inv, att, interleave=cfg.rope_interleave)
    if s.type is RopeType.llama3:
        return RopeTables(_llama3(cfg.rope_theta, dim, s), interleave=cfg.rope_interleave)
    if s.type is RopeType.longrope:
        orig = s.original_max_position_embeddings or cfg.max_position_embeddings
        factor = cfg.max_position_embeddings / orig
        default_att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        shape = np.arange(0, dim, 2, dtype=np.float32) / dim
        short = (1.0 / (np.asarray(s.short_factor, np.float32) * cfg.rope_theta ** shape)).astype(np.float32)
        long = (1.0 / (np.asarray(s.long_factor, np.float32) * cfg.rope_theta ** shape)).astype(np.float32)
        return RopeTables(short, s.short_mscale if s.short_mscale is not None else default_att,
                          long_inv_freq=long,
                          long_attention_factor=s.long_mscale if s.long_mscale is not None else default_att,
                          switch_len=orig, interleave=cfg.rope_interleave)
    raise ValueError(f"model config: rope_scaling.type: unsupported {s.type}")


def cos_sin(tables: RopeTables, positions: jnp.ndarray, total_len: Optional[jnp.ndarray] = None
            ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin [..., rot_dim/2] for integer `positions` [...]; `total_len` selects longrope tables."""
    pos = positions.astype(jnp.float32)[..., None]
    inv = jnp.asarray(tables.inv_freq)
    att = tables.attention_factor
    if tables.long_inv_freq is not None:
        use_long = total_len > tables.switch_len
        inv = jnp.where(use_long, jnp.asarray(tables.long_inv_freq), inv)
        att = jnp.where(use_long, tables.long_attention_factor, att)
    ang = pos * inv
    return jnp.cos(ang) * att, jnp.sin(ang) * att


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, interleave: bool = False) -> jnp.ndarray:
    """Rotate x [..., S, heads, rot_dim] with cos/sin [..., S, rot_dim/2] (broadcast over heads)."""
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    if interleave:
        # DeepSeek: pairs (2i, 2i+1) are de-interleaved to halves, rotated, and kept in halves,
        # exactly as the reference implementation does before its rotate-half.
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
