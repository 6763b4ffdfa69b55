"""models.native on block-quantized weights (ggml's Q8_0, Q4_0, Q4_K, Q6_K blocks, byte for byte) and the AMX
paths: every kernel against "round the operands as the kernels do, matmul in float64" (`qlinear_reference`: the
activations quantized as llama.cpp does and gguf.quants.dequantize for the blocks on the vector paths; weights
dequantized then both rounded to bf16 on the AMX tiles, `native.block_rounding` says which), on every ISA path this
CPU has (AMX, AVX512-VNNI, AVX2, scalar; the others skip), at random shapes that cover the tails (K % 64 == 32 for
the 32-weight types, activation rows 1..40 across the 4-row micro-kernels and the AMX thresholds, odd N).

Tolerance: f32 summation error, 1e-5 of the sum of |products| of the rounded operands per output. One wrong
nibble, scale or offset moves an output by a large fraction of that sum (checked by swapping Q4_K's nibble
order in the AVX-512 unpacker: test_qlinear_host[q4_k-avx512bf16] fails; the AMX tiles' mutations are named at
test_amx_block_tiles)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models import native
from models.quant.blocks import QuantArray
from tests.conftest import NATIVE_ISAS as ISAS

BF16 = ml_dtypes.bfloat16
QTYPES = ["q8_0", "q4_0", "q4_k", "q6_k"]


def bound(x: np.ndarray, w: QuantArray, rounding: str | None = None) -> np.ndarray:
    """1e-5 of sum |x'| |w'| per output (x', w' rounded as the kernels round them: `native.rounded_operands`): the f32
    summation tolerance."""
    xr, wr = native.rounded_operands(np.asarray(x, np.float32).reshape(-1, w.shape[1]), w, rounding)
    return 1e-5 * (np.abs(xr.astype(np.float64)) @ np.abs(wr.astype(np.float64)).T) + 1e-30


def cols_for(qtype: str, rng: np.random.Generator) -> int:
    if qtype in ("q8_0", "q4_0"):
        return 32 * int(rng.integers(1, 24))  # odd counts of 32 leave a half 64-weight group
    return 256 * int(rng.integers(1, 4))


@pytest.mark.parametrize("qtype", QTYPES)
def test_qlinear_host(isa, qtype):
    rng = np.random.default_rng(QTYPES.index(qtype))
    for M in (1, 3, 6, 17, 40):
        K, N = cols_for(qtype, rng), int(rng.integers(1, 70))
        w = native.random_blocks(rng, qtype, N, K)
        x = rng.standard_normal((M, K)).astype(np.float32)
        y = native.linear_host(x, w, threads=2)
        ref = native.qlinear_reference(x, w)
        assert y.shape == (M, N)
        assert np.all(np.abs(y - ref) <= bound(x, w)), (isa, qtype, M, K, N, np.abs(y - ref).max())


def test_qlinear_host_bf16_x_and_threads_identical(isa):
    rng = np.random.default_rng(7)
    for qtype in QTYPES:
        w = native.random_blocks(rng, qtype, 300, 512)
        x = rng.standard_normal((20, 512)).astype(BF16)
        y1 = native.linear_host(x, w, threads=1)
        y2 = native.linear_host(x, w, threads=2)
        np.testing.assert_array_equal(y1, y2)
        ref = native.qlinear_reference(x.astype(np.float32), w)
        assert np.all(np.abs(y1 - ref) <= bound(x.astype(np.float32), w)), qtype


@pytest.mark.parametrize("qtype", QTYPES)
def test_qlinear_rows_independent_of_call_size(qtype):
    """AVX-512 path, K over several 2048-weight chunks: row m of an M-row call is the 1-row call on that row, bit for
    bit, for M = 2..7 (one pass, every weight block applied to all rows; Q8_0 / Q4_0 also 8) and, for Q4_0 at M =
    9..13 and Q8_0 at 9 (K in chunks, partial sums carried as vectors). Q4_K / Q6_K take kgemm's tiles from 8 rows
    (8: two lanes a row, a class of its own), Q8_0 from 12 (ms_qpath 1): rows of calls of >= 9 rows on that path are
    equal (M = 9 / 13 here), not to the 1-row call's (f32 summation order); all match the reference (a chunk's sums
    dropped or added twice would not)."""
    if native.best_isa() not in ("amx", "avx512bf16"):
        pytest.skip(f"no AVX512-VNNI path: best {native.best_isa()}")
    rng = np.random.default_rng(11 + QTYPES.index(qtype))
    K = 32 * 143 if qtype in ("q8_0", "q4_0") else 256 * 19  # 4576 / 4864: 3 chunks, a half group for Q8_0 / Q4_0
    w = native.random_blocks(rng, qtype, 37, K)
    x = rng.standard_normal((13, K)).astype(np.float32)
    native.set_isa("avx512bf16")
    try:
        single = np.concatenate([native.linear_host(x[m:m + 1], w, threads=1) for m in range(13)])
        tiles = native.linear_host(x, w, threads=2)  # 13 rows: kgemm's tiles for the K-quants
        path = {M: native.load().ms_qpath(native.QTYPE_IDS[qtype], M) for M in range(1, 14)}
        kquant = qtype in ("q4_k", "q6_k")
        for M in (2, 3, 4, 5, 6, 7, 8, 9, 13):
            if kquant and M == 8:
                continue
            same = tiles if path[M] == 1 else single
            np.testing.assert_array_equal(native.linear_host(x[:M], w, threads=2), same[:M], err_msg=f"M={M}")
        eight = native.linear_host(x[:8], w, threads=2)
    finally:
        native.set_isa(None)
    assert [path[M] for M in (7, 8, 9)] == ([0, 1, 1] if kquant else [0, 0, 0])
    ref = native.qlinear_reference(x, w, "q8")  # the AVX-512 path's rounding (the default path may be AMX's)
    for y in (single, tiles, eight):
        assert np.all(np.abs(y - ref[:len(y)]) <= bound(x[:len(y)], w, "q8")), np.abs(y - ref[:len(y)]).max()


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "q8_0"])
def test_kgemm_tiles(qtype):
    """The path for calls of >= 8 rows (Q4_K, Q6_K; Q8_0 >= 12) on AVX-512 (kgemm: tiles of 16 activation lanes,
    weight codes broadcast; ms_qpath 1) is taken by row count and matches the reference: one tile (8 K-quant rows: two
    lanes a row; 9 or 12: partly zero rows); three tiles (a pair of tiles, then the odd one) over K in two chunks of
    the panel (the last shorter) with N not a multiple of the 8-row weight blocks; four tiles; ten (two passes over the
    weights: 8 tiles, then 2). A row's output is the same bits in every call of >= 9 rows (one row fewer than the first: the pair kernels, within the reference's
    tolerance only)."""
    if native.best_isa() not in ("amx", "avx512bf16"):
        pytest.skip(f"no AVX512-VNNI path: best {native.best_isa()}")
    lib, qid = native.load(), native.QTYPE_IDS[qtype]
    rng = np.random.default_rng(23 + ["q4_k", "q6_k", "q8_0"].index(qtype))
    # K past the 64-row call's chunk (Q4_K 22 super-blocks, Q6_K 18, Q8_0 153 blocks): a tail chunk
    K, first = (32 * 301, 12) if qtype == "q8_0" else (256 * 23, 8)
    w = native.random_blocks(rng, qtype, 19, K)
    x = rng.standard_normal((150, K)).astype(np.float32)
    native.set_isa("avx512bf16")
    try:
        assert [lib.ms_qpath(qid, m) for m in (1, first - 1, first, 16, 40)] == [0, 0, 1, 1, 1]
        ys = {M: native.linear_host(x[:M], w, threads=2) for M in (first - 1, first, 12, 37, 64, 150)}
    finally:
        native.set_isa(None)
    ref = native.qlinear_reference(x, w, "q8")
    for M, y in ys.items():
        assert np.all(np.abs(y - ref[:M]) <= bound(x[:M], w, "q8")), (qtype, M, np.abs(y - ref[:M]).max())
    np.testing.assert_array_equal(ys[37], ys[64][:37])
    np.testing.assert_array_equal(ys[12], ys[64][:12])
    np.testing.assert_array_equal(ys[64], ys[150][:64])


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k"])
def test_kquant_extreme_blocks(isa, qtype):
    """K-quant blocks at the ends of their ranges (every code at its maximum, 6-bit scales / mins 63, Q6_K's int8
    scales -128 and 127) against activations of one sign and of alternating sign, so every 4-product integer sum of
    the super-block kernels is at its largest (4 x 63 x 127 for Q6_K): nothing may saturate on the way (the AVX-512
    kernel packs two outputs' 4-product sums into 16 bits); odd row counts take the weight-paired path, 8 and 11 rows
    kgemm's tiles (sub-block sums in int32, Q6_K's from -32 x the 16-sum)."""
    rows, K = 9, 512
    nbytes = 144 if qtype == "q4_k" else 210
    data = np.full((rows, K // 256, nbytes), 0xFF, np.uint8)
    d = np.array([1e-3], np.float16).view(np.uint8)
    if qtype == "q4_k":
        data[:, :, 0:2] = d
        data[:, :, 2:4] = np.array([-5e-4], np.float16).view(np.uint8)  # dmin < 0: the min term adds to the codes' term
    else:
        data[:, :, 192:208] = np.where(np.arange(16) % 3 == 0, 0x80, 0x7F).astype(np.uint8)  # scales -128 / 127
        data[1::2, :, 192:208] = 0x80
        data[:, :, 208:210] = d
    w = QuantArray(data.reshape(rows, -1), qtype, (rows, K))
    x = np.ones((5, K), np.float32)
    x[1] = -1.0
    x[2] = np.where(np.arange(K) % 2 == 0, 1.0, -1.0)
    x[3] = np.where((np.arange(K) // 16) % 2 == 0, 2.0, -1.0)
    x[4] = np.linspace(-1.0, 1.0, K, dtype=np.float32)
    x = np.concatenate([x, x[::-1], x[:1]])  # 11 rows: kgemm's tiles on the AVX-512 path
    for M in (1, 2, 3, 5, 8, 11):
        y = native.linear_host(x[:M], w, threads=1)
        ref = native.qlinear_reference(x[:M], w)
        assert np.all(np.abs(y - ref) <= bound(x[:M], w)), (isa, qtype, M, np.abs(y - ref).max())


def extreme_rows(K: int) -> np.ndarray:
    """9 activation rows whose Q8 codes are at +-127: of one sign, alternating, in steps, a ramp, and 4 random rows."""
    x = np.ones((9, K), np.float32)
    x[1] = -1.0
    x[2] = np.where(np.arange(K) % 2 == 0, 1.0, -1.0)
    x[3] = np.where((np.arange(K) // 16) % 2 == 0, 3.0, -1.0)
    x[4] = np.linspace(-1.0, 1.0, K, dtype=np.float32)
    x[5:] = np.random.default_rng(5).standard_normal((4, K)).astype(np.float32)
    return x


def assert_extreme_rows_within_bound(w: QuantArray, isa: str) -> None:
    """w against the first M of extreme_rows, for M = 1..9 (every row count of the micro-kernels)."""
    x = extreme_rows(w.shape[1])
    for M in range(1, 10):
        y = native.linear_host(x[:M], w, threads=1)
        ref = native.qlinear_reference(x[:M], w)
        assert np.all(np.abs(y - ref) <= bound(x[:M], w)), (isa, M, np.abs(y - ref).max())


def test_q4_0_extreme_blocks(isa):
    """Q4_0 blocks at the ends of their range (every code 15 or 0, scales of both signs) against activations of one
    sign, of alternating sign and in steps, so the AVX-512 kernel's 8-product sums (8 x 15 x 127) and their pair sums
    (packed into 16 bits twice on the way to one int32 per block and weight row) are at their largest; 9 weight rows
    leave a weight-row quad with one row, K = 608 a last unit of 3 blocks, and M = 1..9 every row count."""
    rows, K = 9, 608
    data = np.zeros((rows, K // 32, 18), np.uint8)
    data[:, :, 2:] = 0xFF
    data[1::3, :, 2:] = 0x00  # codes 0: weights -8 d
    data[2::3, :, 2:] = 0xF0  # codes 0 (weights 0..15) and 15 (16..31)
    data[:, :, 0:2] = np.array([1e-3], np.float16).view(np.uint8)
    data[::2, 1::2, 0:2] = np.array([-2.5e-3], np.float16).view(np.uint8)
    w = QuantArray(data.reshape(rows, -1), "q4_0", (rows, K))
    assert_extreme_rows_within_bound(w, isa)


def test_activation_quantization_as_the_kernels(isa):
    """The numpy activation rounding is the one the kernels use, bit for bit (ties, zeros, a repeated max), on every
    ISA path (the AVX-512 paths quantize per-32 blocks with vector code, the others with scalar code)."""
    rng = np.random.default_rng(3)
    lib = native.load()
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[1] = 0.0
    x[2, :256] = np.float32(2.0)
    x[2, 7] = -2.0
    x[3] = (np.arange(512) % 9 - 4) * np.float32(0.5)  # scaled halves
    x[4, 32:64] = np.float32(127 / 2) * np.linspace(-1, 1, 32, dtype=np.float32)
    x[5] = (np.arange(512) % 64 - 32) * np.float32(0.25)  # with a max of 63.5 per block, d = 0.5: v / d has every
    x[5, ::32] = np.float32(63.5)  # tie k + 1/2 of both signs from -16 to 15
    for qtype in QTYPES:
        q = np.empty(x.shape, np.int8)
        B = 32 if qtype in ("q8_0", "q4_0") else 256
        d = np.empty((6, 512 // B), np.float32)
        assert lib.ms_qquantize(x.ctypes.data, 6, 512, native.QTYPE_IDS[qtype], q.ctypes.data, d.ctypes.data) == 0
        qn, dn = native.quantize_activations(x, qtype)
        np.testing.assert_array_equal(q, qn, err_msg=qtype)
        np.testing.assert_array_equal(d, dn, err_msg=qtype)


def test_q8_0_extreme_blocks(isa):
    """Q8_0 blocks of codes -128 / 127 (and both, in halves and alternating), against the extreme activation rows: the
    AVX2 kernel's pair sums |w| * q (at most 2 * 128 * 127) and the AVX-512 kernel's unsigned codes are at their largest;
    9 weight rows, K = 608 (a last unit of 3 blocks on AVX-512, a lone block on AVX2's pairs), M = 1..9."""
    rows, K = 9, 608
    codes = np.full((rows, K // 32, 32), -128, np.int8)
    codes[1::4] = 127
    codes[2::4, :, 16:] = 127
    codes[3::4, :, ::2] = 127
    data = np.zeros((rows, K // 32, 34), np.uint8)
    data[:, :, 2:] = codes.view(np.uint8)
    data[:, :, 0:2] = np.array([1e-3], np.float16).view(np.uint8)
    data[::2, 1::2, 0:2] = np.array([-2.5e-3], np.float16).view(np.uint8)
    w = QuantArray(data.reshape(rows, -1), "q8_0", (rows, K))
    assert_extreme_rows_within_bound(w, isa)


def quantized_row_bytes(x: np.ndarray, qtype: str) -> np.ndarray:
    """Every byte the kernels read of x quantized for `qtype` weights (uint8 [M, ms_qrow_bytes]) on the current path."""
    lib = native.load()
    n = lib.ms_qrow_bytes(native.QTYPE_IDS[qtype], x.shape[1])
    out = np.zeros((x.shape[0], n), np.uint8)
    assert lib.ms_qquantize_rows(x.ctypes.data, x.shape[0], x.shape[1], native.QTYPE_IDS[qtype], out.ctypes.data) == 0
    return out


def test_activation_bytes_as_the_scalar_path(isa):
    """Every byte of the quantized activations (q, the lane terms nxo / dl / xs, the 16-sums bs, the K-quants' kx, the
    32-weight units) is the scalar loop's, bit for bit, on every ISA path (the AVX-512 and AVX2 paths round with vector
    code): random rows, zeros, a largest magnitude repeated with both signs (the first one gives Q8_K's scale), every
    x.5 tie, subnormals, inf and NaN. And bs is numpy's sums of 16 of numpy's q (the finite, normal rows)."""
    rng = np.random.default_rng(11)
    for qtype in QTYPES:
        K = 800 if qtype in ("q8_0", "q4_0") else 768  # 25 blocks of 32 (a 1-block unit last); 3 super-blocks
        x = rng.standard_normal((10, K)).astype(np.float32)
        x[1] = 0.0
        x[2, 300] = -9.0  # the first of the largest in its 32 / 256
        x[2, 310] = 9.0
        x[3] = (np.arange(K) % 64 - 32) * np.float32(0.25)
        x[3, ::32] = np.float32(63.5)  # Q8_0's d = 0.5: every tie k + 1/2 of both signs
        x[4] = rng.standard_normal(K).astype(np.float32) * np.float32(1e-39)  # subnormal
        x[5] *= np.float32(1e4) ** rng.uniform(-1, 1, K).astype(np.float32)
        x[6, 40] = np.inf
        x[7, 500] = np.nan
        x[8, 260] = -np.inf
        x[9, 0] = np.nan
        x[9, 1:] = 0.0
        got = quantized_row_bytes(x, qtype)
        native.set_isa("scalar")
        want = quantized_row_bytes(x, qtype)
        native.set_isa(isa)
        for m in range(len(x)):
            np.testing.assert_array_equal(got[m], want[m], err_msg=f"{qtype} row {m}")
        finite = [0, 1, 2, 3, 5]  # (row 4's Q8_K iscale overflows to inf: numpy's int8 cast of inf is undefined)
        q, _ = native.quantize_activations(x[finite], qtype)
        kp = (K + 63) // 64 * 64
        bs = got[finite, 4 * kp : 4 * kp + kp // 8].view(np.int16)[:, : K // 16]
        np.testing.assert_array_equal(bs, q.reshape(len(finite), K // 16, 16).sum(-1, dtype=np.int64), err_msg=qtype)


def make_routing(rng, T, E, k):
    pairs = sorted((int(e), t) for t in range(T) for e in rng.choice(E, size=k, replace=False))
    tokens = np.array([t for _, t in pairs], np.int32)
    offsets = np.searchsorted([e for e, _ in pairs], np.arange(E + 1)).astype(np.int64)
    weights = rng.uniform(0.1, 1.0, size=len(pairs)).astype(np.float32)
    return offsets, tokens, weights


def quant_experts(rng, E, H, F, qgu, qdn):
    gates = [native.random_blocks(rng, qgu, F, H, 0.02) for _ in range(E)]
    ups = [native.random_blocks(rng, qgu, F, H, 0.02) for _ in range(E)]
    downs = [native.random_blocks(rng, qdn, H, F, 0.02) for _ in range(E)]
    return gates, ups, downs


def experts_bound(x, gates, ups, downs, offsets, tokens, pw):
    """Per-output tolerance of a layer: 1e-5 of sum_p |pw| (|h_p| |down|), h from the reference, plus a
    one-step change of any rounded h element (the kernels' g, u differ from the reference's by f32 error,
    so an h element may round one step apart: a Q8 step d_h, or a bf16 step <= 2^-7 |h| on the AMX tiles, times
    |down| per element, summed)."""
    T, H = x.shape
    tol = np.zeros((T, H))
    for e in range(len(gates)):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi == lo:
            continue
        tok = tokens[lo:hi]
        g = native.qlinear_reference(x[tok], gates[e])
        u = native.qlinear_reference(x[tok], ups[e])
        h = (g / (1 + np.exp(-g)) * u).astype(np.float32)
        hr, dn = (np.abs(v.astype(np.float64)) for v in native.rounded_operands(h, downs[e]))
        if native.block_rounding(downs[e].qtype, len(tok)) == "bf16":
            step = np.abs(h.astype(np.float64)) * 2.0**-7
        else:
            q, d = native.quantize_activations(h, downs[e].qtype)
            step = np.abs(np.repeat(d, h.shape[1] // d.shape[1], axis=1).astype(np.float64))
        t = 1e-5 * (hr @ dn.T) + 2 * step @ dn.T
        np.add.at(tol, tok, np.abs(pw[lo:hi, None]) * t)
    return tol + 1e-30


def check_qexperts(rng: np.random.Generator, E: int, H: int, F: int, T: int, k: int, qgu: str, qdn: str) -> None:
    """A layer of random block experts (gate / up `qgu`, down `qdn`) on T routed tokens: the three thread plans
    bit-identical and within `experts_bound` of the reference (which rounds each projection as the kernels do)."""
    gates, ups, downs = quant_experts(rng, E, H, F, qgu, qdn)
    x = rng.standard_normal((T, H)).astype(np.float32)
    offsets, tokens, pw = make_routing(rng, T, E, k)
    ref = native.qexperts_host_reference(np.zeros((T, H), np.float32), x, gates, ups, downs, offsets, tokens, pw)
    tol = experts_bound(x, gates, ups, downs, offsets, tokens, pw)
    packed = native.pack_experts(gates, ups, downs)
    outs = []
    for strategy in ("rows", "experts", "auto"):
        out = np.zeros((T, H), np.float32)
        native.experts_host(out, x, packed, None, None, offsets, tokens, pw, threads=2, strategy=strategy)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    assert np.all(np.abs(outs[0] - ref) <= tol), (qgu, qdn, np.abs(outs[0] - ref).max())


@pytest.mark.parametrize("qgu,qdn", [("q8_0", "q8_0"), ("q4_0", "q8_0"), ("q4_k", "q6_k"), ("q4_k", "q4_k")])
def test_qexperts_host(isa, qgu, qdn):
    check_qexperts(np.random.default_rng(11), 4, 256, 512, 18, 2, qgu, qdn)


def test_jax_ffi_and_xla_reference():
    """linear / swiglu / experts on QuantArrays inside jit (the FFI kernels) and the pure-XLA reference path
    (another backend's) against the numpy references."""
    if not native.available_experts():
        pytest.skip(f"native FFI unavailable: {native.build_error()}")
    rng = np.random.default_rng(5)
    H, F, T, E = 256, 256, 9, 2
    for qgu, qdn in (("q4_k", "q6_k"), ("q8_0", "q4_0")):
        first = qgu == "q4_k"  # the pure-XLA references once (their compiles dominate the test's time)
        gates, ups, downs = quant_experts(rng, E, H, F, qgu, qdn)
        gu = [QuantArray(np.concatenate([g.data, u.data]), qgu, (2 * F, H)) for g, u in zip(gates, ups)]
        x = rng.standard_normal((T, H)).astype(np.float32)
        w = gates[0]
        y = jax.jit(lambda x: native.linear(x, w))(jnp.asarray(x))  # a QuantArray is not a pytree: closed over
        ref = native.qlinear_reference(x, w)
        assert np.all(np.abs(np.asarray(y) - ref) <= bound(x, w))
        xla = native.qlinear_jax_reference(jnp.asarray(x), jnp.asarray(w.data), w.qtype)
        assert np.all(np.abs(np.asarray(xla) - ref) <= 10 * bound(x, w)), qgu
        np.testing.assert_allclose(np.asarray(native.dequantize_jax(jnp.asarray(downs[0].data), qdn, F)),
                                   native.dequantize(downs[0]), rtol=1e-6, atol=0)
        np.testing.assert_allclose(np.asarray(native.dequantize_jax(jnp.asarray(w.data), qgu, H)), native.dequantize(w),
                                   rtol=1e-6, atol=0)
        s = jax.jit(lambda x: native.swiglu(x, gu[0], downs[0]))(jnp.asarray(x))
        offsets = np.array([0, T], np.int64)
        tol = experts_bound(x, gates[:1], ups[:1], downs[:1], offsets, np.arange(T, dtype=np.int32), np.ones(T, np.float32))
        sref = native.qswiglu_reference(x, gates[0], ups[0], downs[0])
        assert np.all(np.abs(np.asarray(s) - sref) <= tol)
        offsets, tokens, pw = make_routing(rng, T, E, 2)
        out = jax.jit(lambda x, t, p, o: native.experts(x, t, p, o, gu, downs))(
            jnp.asarray(x), jnp.asarray(tokens), jnp.asarray(pw), jnp.asarray(offsets.astype(np.int32)))
        ref = native.qexperts_host_reference(np.zeros((T, H), np.float32), x, gates, ups, downs, offsets, tokens, pw)
        assert np.all(np.abs(np.asarray(out) - ref) <= experts_bound(x, gates, ups, downs, offsets, tokens, pw))
        if not first:
            continue
        xla = native.qexperts_reference(jnp.asarray(x), tokens, pw, offsets, gu, downs)
        assert np.all(np.abs(np.asarray(xla) - ref) <= 10 * experts_bound(x, gates, ups, downs, offsets, tokens, pw))


def test_bf16_amx_matches_avx512():
    """The AMX-BF16 path (calls of >= 16 rows) against the AVX512-BF16 one: both exact products, f32 sums."""
    if native.best_isa() != "amx":
        pytest.skip(f"this CPU (or kernel) has no AMX: best path {native.best_isa()}")
    rng = np.random.default_rng(2)
    try:
        for M, K, N in ((16, 100, 37), (17, 1000, 65), (40, 64, 33), (33, 2048, 80)):
            x = rng.standard_normal((M, K)).astype(BF16)
            w = (rng.standard_normal((N, K)) * 0.05).astype(BF16)
            native.set_isa("avx512bf16")
            a = native.linear_host(x, w)
            native.set_isa("amx")
            b = native.linear_host(x, w)
            tol = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)
            assert np.all(np.abs(a - b) <= tol)
    finally:
        native.set_isa(None)


def _need_amx():
    if native.best_isa() != "amx":
        pytest.skip(f"this CPU (or kernel) has no AMX: best path {native.best_isa()}")


@pytest.mark.parametrize("qtype", QTYPES)
def test_amx_block_tiles(qtype):
    """The block types' AMX path (weights dequantized to bf16 per 16-row strip and 256 weights, double-buffered; bf16
    tiles over up to 64 activation rows) taken at every row count: against the bf16-rounding reference at 1..71 rows
    (one and two 64-row passes, partial tiles), 37 outputs (a partial strip) and K over several 256-weight chunks
    (Q8_0 / Q4_0: a short last chunk ending in half a 64-weight group); thread counts bit-identical. Mutations that
    fail it: the next chunk dequantized only while two more follow (the last chunk stale), Q4_K's two sub-block
    tables swapped, Q4_0's nibbles both read as low ones; for over 64 rows (the whole strip staged by the first pass,
    read by the later ones: 130 rows in passes of 5 + 4 C tiles; 71 and 96 rows in one pass of 5 and 6), the later
    passes reading the double-buffered layout, C tile 5 left out of the pass."""
    _need_amx()
    rng = np.random.default_rng(21 + QTYPES.index(qtype))
    K = 32 * 19 if qtype in ("q8_0", "q4_0") else 256 * 3
    w = native.random_blocks(rng, qtype, 37, K)
    native.set_isa("amx")
    native.set_amx_rows(qtype, 1)
    try:
        for M in (1, 5, 16, 33, 71, 96, 130):
            assert native.block_rounding(qtype, M) == "bf16"
            x = rng.standard_normal((M, K)).astype(np.float32)
            y = native.linear_host(x, w, threads=2)
            np.testing.assert_array_equal(y, native.linear_host(x, w, threads=1))
            ref = native.qlinear_reference(x, w, "bf16")
            assert np.all(np.abs(y - ref) <= bound(x, w, "bf16")), (qtype, M, np.abs(y - ref).max())
    finally:
        native.set_amx_rows(qtype, None)
        native.set_isa(None)


def _amx_rows_as_16_row_calls(wtype: str, seed: int, N: int, rows: tuple[int, ...], threads: int,
                              reference_below: int) -> None:
    """AMX calls of each row count in `rows` against [N, 14336] weights of `wtype` (bf16 or a block type; `threads`
    threads): every output row bit for bit what a 16-row call of the same rows gives (the last one ending at M: bf16
    takes the tiles from 16 rows), and calls of fewer than `reference_below` rows of the block types within the
    bf16-rounding reference."""
    _need_amx()
    rng = np.random.default_rng(seed)
    K = 14336
    if wtype == "bf16":
        w = (rng.standard_normal((N, K)) * 0.05).astype(BF16)
    else:
        w = native.random_blocks(rng, wtype, N, K)
        native.set_amx_rows(wtype, 1)
    native.set_isa("amx")
    try:
        for M in rows:
            x = rng.standard_normal((M, K)).astype(np.float32)
            if wtype == "bf16":
                x = x.astype(BF16)
            y = native.linear_host(x, w, threads=threads)
            for r in range(0, M, 16):
                s0 = min(r, M - 16)
                np.testing.assert_array_equal(y[r:r + 16], native.linear_host(x[s0:s0 + 16], w, threads=1)[r - s0:])
            if M < reference_below and wtype != "bf16":
                ref = native.qlinear_reference(x, w, "bf16")
                assert np.all(np.abs(y - ref) <= bound(x, w, "bf16")), (wtype, M, np.abs(y - ref).max())
    finally:
        if wtype != "bf16":
            native.set_amx_rows(wtype, None)
        native.set_isa(None)


@pytest.mark.parametrize("wtype", ["bf16"] + QTYPES)
def test_amx_row_groups(wtype):
    """Calls whose bf16 B panel would outgrow L2 (rows x K x 2 bytes over 1 MiB), K = 14336, 2 threads: 97 rows take K
    in blocks (`test_amx_k_blocks`), 130 / 200 rows their activation rows in groups (bf16: 4 + 4 + 1 and 4 + 4 + 4 + 1
    tiles, the block types 5 + 4 and 5 + 5 + 3), each group K-blocked: each row bit for bit what a 16-row call of the
    same rows gives (a row's tile sums do not depend on which rows share its call), and the block types stay within
    the bf16-rounding reference. Mutations that fail it: the groups' outputs written at the first group's rows, a
    group's panel slice taken one tile late."""
    _amx_rows_as_16_row_calls(wtype, 29, 21, (97, 130, 200), threads=2, reference_below=1 << 30)


@pytest.mark.parametrize("wtype", ["bf16", "q6_k"])
def test_amx_k_blocks(wtype):
    """AMX calls of up to 8 activation tiles whose activation panel would outgrow L2 take K in blocks over groups of
    weight strips, each strip's C tiles saved between blocks (K 14336: 72 rows in 3 blocks over groups of 51 strips;
    128 rows in 4 blocks over groups of 32 strips, so 530 weight rows on one thread make 2 groups, the last strip
    partial), and past 8 tiles row groups, each K-blocked (200 rows): every output bit for bit what a 16-row call of
    the same rows gives (those run K in one block: the sums go on in the same order), Q6_K at 72 rows within the
    bf16-rounding reference. Mutations that fail it (both weight types): every strip of a group saving its tiles at
    the group's first strip's place, a block's tiles zeroed instead of restored, the next group starting one strip
    late."""
    _amx_rows_as_16_row_calls(wtype, 41, 530, (72, 128, 200), threads=1, reference_below=100)


def test_silu_mul_matches_scalar():
    """The block-quantized experts' SiLU, h = g / (1 + exp(-g)) * u in f32 with exp(-g) the correctly rounded f32 (an
    f64 exp rounded once): the AVX-512 path gives the scalar loop's bits on 2 million values (normal and wide random
    g, and the edges: 0, -0, tiny, the f32 exp overflow / underflow thresholds, +-inf, NaN, at every lane position),
    and both give numpy's f64-exp formula's bits on the finite ones. Mutations that fail it: the polynomial cut to
    degree 4 (degree 5, ~2^-43, misrounds too rarely to show here), the table index one entry off, the scalar loop
    back on glibc's expf (1 ulp apart on ~0.03 %)."""
    lib = native.load()
    if lib is None:
        pytest.skip("native library unavailable")
    rng = np.random.default_rng(31)
    edges = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-45, 88.72, -88.72, 89.5, -89.5, 103.9, -103.9, 104.5, 150.0,
                      -150.0, 200.0, -200.0, np.inf, -np.inf, np.nan, 0.5, -0.5], np.float32)
    g = np.concatenate([rng.standard_normal(1_000_000) * 5, rng.uniform(-110, 110, 1_000_000),
                        np.tile(edges, 16 * 3), np.repeat(edges, 17)]).astype(np.float32)
    u = rng.standard_normal(g.size).astype(np.float32)
    out = [np.empty_like(g) for _ in range(2)]
    for vec, h in enumerate(out):
        lib.ms_silu_mul(g.ctypes.data, u.ctypes.data, h.ctypes.data, g.size, vec)
    np.testing.assert_array_equal(out[1].view(np.uint32), out[0].view(np.uint32))
    fin = np.isfinite(g)
    with np.errstate(over="ignore"):  # exp(-g) past the f32 range: inf, as the kernel's
        e = np.exp(-g[fin].astype(np.float64)).astype(np.float32)
        ref = (g[fin] / (np.float32(1) + e)) * u[fin]
    np.testing.assert_array_equal(out[0][fin].view(np.uint32), ref.view(np.uint32))


def test_amx_block_tiles_in_experts():
    """Layers of experts whose every projection takes the AMX tiles (thresholds at 1 row), Q4_K_M's mix (Q4_K gate /
    up, Q6_K down) and Q8_0 / Q4_0: against the references (which round each projection as the kernels do), the
    three thread plans bit-identical."""
    _need_amx()
    rng = np.random.default_rng(13)
    native.set_isa("amx")
    for q in QTYPES:
        native.set_amx_rows(q, 1)
    try:
        for qgu, qdn in (("q4_k", "q6_k"), ("q8_0", "q4_0")):
            check_qexperts(rng, 3, 256, 512, 24, 2, qgu, qdn)
    finally:
        for q in QTYPES:
            native.set_amx_rows(q, None)
        native.set_isa(None)


def test_bf16_tiles_error_below_q8_activations():
    """The AMX tiles' rounding (weights and activations to bf16) against the vector paths' (activations to Q8_0 /
    Q8_K, weights exact), each measured from the kernels' outputs against the exact f64 product of the f32
    activations and the dequantized weights: the tiles' RMS error is the smaller for every type (measured 0.3-0.5x
    of the Q8 activations' on these shapes)."""
    _need_amx()
    rng = np.random.default_rng(17)
    try:
        for qtype in QTYPES:
            w = native.random_blocks(rng, qtype, 96, 1024)
            x = rng.standard_normal((32, 1024)).astype(np.float32)
            exact = x.astype(np.float64) @ native.dequantize(w).astype(np.float64).T
            native.set_isa("amx")
            assert native.block_rounding(qtype, 32) == "bf16"
            tiles = native.linear_host(x, w)
            native.set_isa("avx512bf16")
            q8 = native.linear_host(x, w)
            rms = [float(np.sqrt(np.mean((y - exact) ** 2))) for y in (tiles, q8)]
            assert rms[0] < 0.75 * rms[1], (qtype, rms)
    finally:
        native.set_isa(None)


def test_quant_bad_input_one_line_errors():
    rng = np.random.default_rng(0)
    w = native.random_blocks(rng, "q4_k", 8, 256)
    with pytest.raises(ValueError, match="expected x"):
        native.linear_host(np.zeros((2, 128), np.float32), w)
    with pytest.raises(ValueError, match="no native kernel"):
        native.linear_host(np.zeros((2, 256), np.float32), QuantArray(np.zeros((8, 512), np.uint8), "bf16", (8, 256)))
    lib = native.load()
    y = np.zeros((1, 8), np.float32)
    assert lib.ms_qlinear(y.ctypes.data, 0, 1, 100, w.data.ctypes.data, 12, 8, y.ctypes.data, 1) == -1
    assert "whole number of 256-weight blocks" in lib.ms_last_error().decode()
    g, u, d = quant_experts(rng, 2, 256, 256, "q8_0", "q8_0")
    with pytest.raises(ValueError, match="expert 1 up"):
        native.pack_experts(g, [u[0], native.random_blocks(rng, "q4_0", 256, 256)], d)
