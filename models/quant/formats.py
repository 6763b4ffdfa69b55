"""Dequantize and quantize ggml's blocks: numpy (host) and jnp (inside a jitted expert).

Dequantizing follows ggml's own arithmetic in float32 (`dequantize_row_*` in ggml-quants.c): every
product of a scale and a quant is exact in float32 (an f16 scale times an integer of at most 8 bits),
so the only rounding is Q4_K's subtraction of the minimum, done once in both implementations here and
in gguf-py; both paths equal `gguf.quants.dequantize` bit for bit (tests/test_quant_blocks.py).

Quantizing: Q8_0, Q4_0 and Q5_0 through gguf-py (`gguf.quants.quantize`, written to match ggml's reference
quantizers bit for bit). gguf-py 0.19 has no quantizer for the K-quants, so Q4_K and Q6_K are
quantized here with llama.cpp's reference algorithm (`quantize_row_q4_K_ref`: per 32-weight sub-block a
weighted least-squares search over 21 trial scales for scale and minimum, weights |x| + rms(x), then
6-bit scales and minima against the block's largest; `quantize_row_q6_K_ref`: per 16-weight sub-block a
search over 19 trial scales weighting each weight by x^2, then 8-bit scales). The search is vectorized
over blocks; its float32 sums are taken in another order than llama.cpp's loops (and llama.cpp's build may
contract them into FMAs), so a sub-block whose trial errors tie to the last bit can pick a neighbouring
scale: the blocks are llama.cpp's algorithm, not always its exact bytes. Without an importance matrix
llama.cpp uses exactly these reference quantizers for Q4_K_M / Q6_K files.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from models.quant.blocks import BlockType, block_type

QK_K = 256
GROUP_MAX_EPS = 1e-15


def blocks_of(data: np.ndarray, t: BlockType) -> np.ndarray:
    """uint8 [..., n * block_bytes] -> uint8 [N, block_bytes] (a view when contiguous)."""
    return np.ascontiguousarray(data).reshape(-1, t.block_bytes)


def _f16(raw: Any, xp: Any) -> Any:
    """Two little-endian bytes [..., 2] -> float32 [...]."""
    if xp is np:
        return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)
    import jax

    return jax.lax.bitcast_convert_type(raw, xp.float16).astype(xp.float32)


# ---- dequantize: one implementation, numpy or jax.numpy (`xp`) ----------------------------------


def _i8(raw: Any, xp: Any) -> Any:
    """uint8 bytes reinterpreted as int8 (two's complement), numpy or jax."""
    if xp is np:
        return np.ascontiguousarray(raw).view(np.int8)
    import jax

    return jax.lax.bitcast_convert_type(raw, xp.int8)


def _q8_0(b: Any, xp: Any) -> Any:
    d = _f16(b[:, 0:2], xp)[:, None]
    return _i8(b[:, 2:34], xp).astype(xp.float32) * d


def _q4_0(b: Any, xp: Any) -> Any:
    d = _f16(b[:, 0:2], xp)[:, None]
    qs = b[:, 2:18]
    q = xp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(xp.int32) - 8
    return d * q.astype(xp.float32)


def _q5_0(b: Any, xp: Any) -> Any:
    d = _f16(b[:, 0:2], xp)[:, None]
    qh = b[:, 2:6].astype(xp.uint32)
    high = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)      # bit j: weight j's fifth bit
    fifth = ((high[:, None] >> xp.arange(32, dtype=xp.uint32)[None, :]) & 1).astype(xp.uint8)
    qs = b[:, 6:22]
    q = (xp.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (fifth << 4)).astype(xp.int32) - 16
    return d * q.astype(xp.float32)


def _k_scales(s: Any, xp: Any) -> tuple[Any, Any]:
    """Q4_K's 12 scale bytes -> (scales, mins) uint8 [N, 8] (6 bits each)."""
    a, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = xp.concatenate([a & 0x3F, (md & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = xp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k(b: Any, xp: Any) -> Any:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2], xp), _f16(b[:, 2:4], xp)
    sc, mn = _k_scales(b[:, 4:16], xp)
    scale = (d[:, None] * sc.astype(xp.float32))[:, :, None]      # [N, 8, 1]
    low = (dmin[:, None] * mn.astype(xp.float32))[:, :, None]
    qs = b[:, 16:144].reshape(n, 4, 1, 32)                        # 64 weights per 32 bytes: low nibbles first
    q = xp.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(xp.float32)
    return (scale * q - low).reshape(n, QK_K)


def _q6_k(b: Any, xp: Any) -> Any:
    n = b.shape[0]
    ql, qh = b[:, 0:128].reshape(n, 2, 1, 64), b[:, 128:192].reshape(n, 2, 1, 32)
    sc = _i8(b[:, 192:208], xp)
    d = _f16(b[:, 208:210], xp)
    low = xp.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)   # [half, quarter, 32]
    high = xp.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], axis=2)
    q = (low | (high << 4)).astype(xp.int32) - 32
    scale = (d[:, None] * sc.astype(xp.float32)).reshape(n, 16, 1)
    return (scale * q.reshape(n, 16, 16).astype(xp.float32)).reshape(n, QK_K)


def _f16_plain(b: Any, xp: Any) -> Any:
    return _f16(b.reshape(b.shape[0], -1, 2), xp)


def _bf16_plain(b: Any, xp: Any) -> Any:
    if xp is np:
        return (np.ascontiguousarray(b).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    import jax

    return jax.lax.bitcast_convert_type(b.reshape(b.shape[0], -1, 2), xp.bfloat16).astype(xp.float32)


def _f32_plain(b: Any, xp: Any) -> Any:
    if xp is np:
        return np.ascontiguousarray(b).view(np.float32)
    import jax

    return jax.lax.bitcast_convert_type(b.reshape(b.shape[0], -1, 4), xp.float32)


_DEQUANT = {"q8_0": _q8_0, "q4_0": _q4_0, "q5_0": _q5_0, "q4_k": _q4_k, "q6_k": _q6_k,
            "f16": _f16_plain, "bf16": _bf16_plain, "f32": _f32_plain}


def dequantize(data: np.ndarray, qtype: str, cols: int) -> np.ndarray:
    """uint8 [rows, row_bytes] blocks -> float32 [rows, cols] (numpy)."""
    t = block_type(qtype)
    rows = int(np.prod(data.shape[:-1])) if data.ndim > 1 else 1
    return _DEQUANT[qtype](blocks_of(data, t), np).reshape(rows, cols)


def dequantize_jnp(data: Any, qtype: str, cols: int) -> Any:
    """uint8 [rows, row_bytes] blocks -> float32 [rows, cols] (jax.numpy; traceable, for jitted experts)."""
    import jax.numpy as jnp

    t = block_type(qtype)
    rows = data.shape[0]
    return _DEQUANT[qtype](data.reshape(-1, t.block_bytes), jnp).reshape(rows, cols)


# ---- quantize -----------------------------------------------------------------------------------


def _rint(x: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round to nearest, ties to even, in float32."""
    return np.rint(x.astype(np.float32)).astype(np.int32)


def _to_f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _qkx2(x: np.ndarray, w: np.ndarray, nmax: int = 15, rmin: float = -1.0, rdelta: float = 0.1,
          nstep: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's make_qkx2_quants over sub-blocks x, w [S, n]: (scale [S], -min [S], levels int [S, n])
    minimising the weighted squared error of scale * L + min over trial inverse scales."""
    f32 = np.float32
    lo = np.minimum(x.min(axis=1), f32(0))
    hi = x.max(axis=1)
    span = hi - lo
    flat = span == 0
    span = np.where(flat, f32(1), span)
    sum_w = w.sum(axis=1)
    sum_x = (w * x).sum(axis=1)
    iscale = (f32(nmax) / span).astype(f32)
    scale = (f32(1) / iscale).astype(f32)
    L = np.clip(_rint(iscale[:, None] * (x - lo[:, None])), 0, nmax)
    diff = scale[:, None] * L + lo[:, None] - x
    best = (w * diff * diff).sum(axis=1)
    mn = lo.copy()
    for step in range(nstep + 1):
        trial = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / span
        La = np.clip(_rint(trial[:, None] * (x - lo[:, None])), 0, nmax).astype(f32)
        sl, sl2, sxl = (w * La).sum(axis=1), (w * La * La).sum(axis=1), (w * La * x).sum(axis=1)
        D = sum_w * sl2 - sl * sl
        ok = D > 0
        Dn = np.where(ok, D, f32(1))
        t_scale = (sum_w * sxl - sum_x * sl) / Dn
        t_min = (sl2 * sum_x - sl * sxl) / Dn
        pos = t_min > 0
        t_min = np.where(pos, f32(0), t_min)
        t_scale = np.where(pos, sxl / np.where(sl2 > 0, sl2, f32(1)), t_scale)
        d = t_scale[:, None] * La + t_min[:, None] - x
        err = (w * d * d).sum(axis=1)
        better = ok & (err < best)
        L = np.where(better[:, None], La.astype(np.int32), L)
        best = np.where(better, err, best)
        scale = np.where(better, t_scale, scale)
        mn = np.where(better, t_min, mn)
    scale = np.where(flat, f32(0), scale)
    L = np.where(flat[:, None], 0, L)
    mn = np.where(flat, lo, mn)
    return scale.astype(f32), (-mn).astype(f32), L


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [N, 256] -> Q4_K blocks uint8 [N, 144] (llama.cpp's quantize_row_q4_K_ref)."""
    f32 = np.float32
    n = x.shape[0]
    sub = x.reshape(n * 8, 32).astype(f32)
    av = np.sqrt((sub * sub).sum(axis=1) / f32(32)).astype(f32)
    scales, mins, L = _qkx2(sub, av[:, None] + np.abs(sub))
    scales, mins, L = scales.reshape(n, 8), mins.reshape(n, 8), L.reshape(n, 8, 32)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    inv_s = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, f32(1)), f32(0)).astype(f32)
    inv_m = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, f32(1)), f32(0)).astype(f32)
    ls = np.clip(_rint(inv_s[:, None] * scales), 0, 63).astype(np.uint8)
    lm = np.clip(_rint(inv_m[:, None] * mins), 0, 63).astype(np.uint8)
    packed = np.zeros((n, 12), np.uint8)
    packed[:, 0:4], packed[:, 4:8] = ls[:, :4], lm[:, :4]
    packed[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    packed[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    d16, dmin16 = (max_scale / f32(63)).astype(np.float16), (max_min / f32(63)).astype(np.float16)
    sc, mn = _k_scales(packed, np)
    d = d16.astype(f32)[:, None] * sc.astype(f32)
    dm = dmin16.astype(f32)[:, None] * mn.astype(f32)
    live = d != 0
    redo = np.clip(_rint((x.reshape(n, 8, 32) + dm[:, :, None]) / np.where(live, d, f32(1))[:, :, None]), 0, 15)
    L = np.where(live[:, :, None], redo, L).astype(np.uint8).reshape(n, 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([_to_f16_bytes(d16), _to_f16_bytes(dmin16), packed, qs], axis=1)


def _qx(x: np.ndarray, nmax: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's make_qx_quants with rmse_type 1 (weights x^2) over sub-blocks x [S, n]:
    (scale [S], levels L + nmax in [0, 2 nmax) int [S, n])."""
    f32 = np.float32
    S = x.shape[0]
    first = np.argmax(np.abs(x), axis=1)  # the first of the largest magnitudes, as the C loop keeps it
    mx = x[np.arange(S), first]
    zero = np.abs(mx) < GROUP_MAX_EPS
    mx = np.where(zero, f32(1), mx)
    w = x * x

    def trial(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lv = np.clip(_rint(iscale[:, None] * x), -nmax, nmax - 1)
        lf = lv.astype(f32)
        return lv, (w * x * lf).sum(axis=1), (w * lf * lf).sum(axis=1)

    L, sumlx, suml2 = trial((f32(-nmax) / mx).astype(f32))
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, f32(1)), f32(0)).astype(f32)
    best = scale * sumlx
    for step in [s for s in range(-9, 10) if s]:
        lv, slx, sl2 = trial((-(f32(nmax) + f32(0.1) * f32(step)) / mx).astype(f32))
        better = (sl2 > 0) & (slx * slx > best * sl2)
        L = np.where(better[:, None], lv, L)
        scale = np.where(better, slx / np.where(sl2 > 0, sl2, f32(1)), scale).astype(f32)
        best = np.where(better, scale * slx, best)
    scale = np.where(zero, f32(0), scale)
    L = np.where(zero[:, None], -nmax, L)  # ggml writes 0 there, i.e. level -nmax
    return scale, L + nmax


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [N, 256] -> Q6_K blocks uint8 [N, 210] (llama.cpp's quantize_row_q6_K_ref)."""
    f32 = np.float32
    n = x.shape[0]
    x = x.astype(f32)
    scales, L = _qx(x.reshape(n * 16, 16))
    scales, L = scales.reshape(n, 16), L.reshape(n, 16, 16)
    first = np.argmax(np.abs(scales), axis=1)
    max_scale = scales[np.arange(n), first]
    empty = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = (f32(-128) / np.where(empty, f32(1), max_scale)).astype(f32)
    d16 = np.where(empty, f32(0), f32(1) / iscale).astype(np.float16)
    sc = np.minimum(127, _rint(iscale[:, None] * scales)).astype(np.int8)
    sc = np.where(empty[:, None], np.int8(0), sc)
    d = d16.astype(f32)[:, None] * sc.astype(f32)
    live = d != 0
    redo = np.clip(_rint(x.reshape(n, 16, 16) / np.where(live, d, f32(1))[:, :, None]), -32, 31) + 32
    L = np.where(live[:, :, None], redo, L)
    L = np.where(empty[:, None, None], 0, L).astype(np.uint8).reshape(n, 2, 4, 32)  # [half, quarter, 32]
    ql = np.concatenate([L[:, :, 0] & 0x0F | ((L[:, :, 2] & 0x0F) << 4),
                         L[:, :, 1] & 0x0F | ((L[:, :, 3] & 0x0F) << 4)], axis=2).reshape(n, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _to_f16_bytes(d16)], axis=1)


def quantize(x: np.ndarray, qtype: str, name: str = "weight") -> np.ndarray:
    """float [rows, cols] -> uint8 [rows, row_bytes] in `qtype`'s blocks. `name` is what an error names."""
    t = block_type(qtype)
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{name}: quantize takes a [rows, cols] matrix, got shape {x.shape}")
    rows, cols = x.shape
    if cols % t.block_elems:
        raise ValueError(f"{name}: a row of {cols} weights is not a whole number of {qtype}'s "
                         f"{t.block_elems}-weight blocks")
    if qtype == "f32":
        return np.ascontiguousarray(x.astype(np.float32)).view(np.uint8).reshape(rows, -1)
    if qtype in ("f16", "bf16"):
        import ml_dtypes

        dt = np.float16 if qtype == "f16" else ml_dtypes.bfloat16
        return np.ascontiguousarray(x.astype(dt)).view(np.uint8).reshape(rows, -1)
    out = np.empty((rows, t.row_bytes(cols)), np.uint8)
    step = max(1, CHUNK_WEIGHTS // cols)  # rows per call: the search's float32 temporaries stay ~tens of MB
    for r in range(0, rows, step):
        out[r:r + step] = _quantize_blocks(x[r:r + step].astype(np.float32).reshape(-1, t.block_elems),
                                           t).reshape(-1, out.shape[1])
    return out


CHUNK_WEIGHTS = 1 << 20


def _quantize_blocks(flat: np.ndarray, t: BlockType) -> np.ndarray:
    """float32 [N, block_elems] -> uint8 [N, block_bytes]."""
    if t.name == "q4_k":
        return quantize_q4_k(flat)
    if t.name == "q6_k":
        return quantize_q6_k(flat)
    import gguf

    return gguf.quants.quantize(flat, gguf.GGMLQuantizationType(t.ggml_id))
