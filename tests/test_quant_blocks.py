"""ggml block formats as moescope's own: dequantize bit-exact with gguf-py, quantize round trips, bad input."""

import gguf
import jax
import numpy as np
import pytest

from models.quant.blocks import QuantArray, block_type
from models.quant.formats import dequantize, dequantize_jnp, quantize

TYPES = ["q8_0", "q4_0", "q5_0", "q4_k", "q6_k"]
SCALE_BYTES = {"q8_0": [(0, 2)], "q4_0": [(0, 2)], "q5_0": [(0, 2)], "q4_k": [(0, 2), (2, 4)], "q6_k": [(208, 210)]}


def random_blocks(qtype: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes with finite f16 scales (random scale bytes could be NaN, whose bits need not match)."""
    rng = np.random.default_rng(seed)
    t = block_type(qtype)
    b = rng.integers(0, 256, (rows * blocks_per_row, t.block_bytes), dtype=np.uint8)
    for lo, hi in SCALE_BYTES[qtype]:
        b[:, lo:hi] = rng.standard_normal(b.shape[0]).astype(np.float16).reshape(-1, 1).view(np.uint8)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    t = block_type(qtype)
    data = random_blocks(qtype, rows=6, blocks_per_row=3)
    cols = 3 * t.block_elems
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t.ggml_id))
    host = dequantize(data, qtype, cols)
    device = np.asarray(jax.jit(lambda d: dequantize_jnp(d, qtype, cols))(data))
    assert ref.shape == host.shape == device.shape == (6, cols)
    np.testing.assert_array_equal(host.view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(device.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype,bound", [("q8_0", 0.01), ("q4_0", 0.12), ("q5_0", 0.06), ("q4_k", 0.09),
                                         ("q6_k", 0.025)])
def test_quantize_round_trip(qtype, bound):
    """Quantize then dequantize: the relative RMS error of Gaussian weights sits at the format's known level."""
    x = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    q = quantize(x, qtype)
    assert q.dtype == np.uint8 and q.shape == (8, block_type(qtype).row_bytes(512))
    back = dequantize(q, qtype, 512)
    rel = np.sqrt(np.mean((back - x) ** 2) / np.mean(x ** 2))
    assert rel < bound
    if qtype == "q8_0":  # its dequantized values are a fixed point of its quantizer
        np.testing.assert_array_equal(quantize(back, qtype), q)


def test_k_quants_beat_the_legacy_types_of_fewer_bits():
    """Q4_K (4.5 bits, searched scale and minimum per 32) beats Q4_0 (4.5 bits, one scale from max|x|); Q6_K
    (6.56 bits) beats Q5_0 (5.5 bits), on rows whose scale varies."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((64, 256)) * rng.uniform(0.1, 2, (64, 1))).astype(np.float32)

    def err(qtype):
        return np.mean((dequantize(quantize(x, qtype), qtype, 256) - x) ** 2)

    assert err("q4_k") < 0.8 * err("q4_0")
    assert err("q6_k") < 0.5 * err("q5_0")


def test_zero_blocks_quantize_to_zero():
    for qtype in TYPES:
        q = quantize(np.zeros((2, 256), np.float32), qtype)
        assert not dequantize(q, qtype, 256).any(), qtype


def test_row_width_not_a_block_multiple_names_the_tensor():
    with pytest.raises(ValueError, match=r"^layers\.3\.w1: a row of 96 weights is not a whole number of q4_k"):
        quantize(np.zeros((4, 96), np.float32), "q4_k", name="layers.3.w1")


def test_quant_array_is_a_pytree_with_static_type():
    q = QuantArray(quantize(np.ones((2, 32), np.float32), "q8_0"), "q8_0", (2, 32))
    leaves, tree = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 1 and leaves[0] is q.data
    out = jax.jit(lambda a: dequantize_jnp(a.data, a.qtype, a.shape[1]))(q)
    np.testing.assert_array_equal(np.asarray(out), dequantize(q.data, "q8_0", 32))


def test_accuracy_metrics_match_their_definitions():
    from models.quant.accuracy import compare

    rng = np.random.default_rng(3)
    ref = rng.standard_normal((2, 5, 7)).astype(np.float32)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    other = ref.copy()
    other[0, 1] = ref[0, 1][::-1]  # one position's distribution reversed
    tokens = rng.integers(0, 7, (2, 5))
    same = compare(ref, ref, tokens)
    assert same["kl_mean"] == 0 and same["top1_agree"] == 1
    nll = -np.mean([ref[w, s, tokens[w, s + 1]] for w in range(2) for s in range(4)])
    assert np.isclose(same["ppl"], np.exp(nll))
    diff = compare(ref, other, tokens)
    kl = np.sum(np.exp(ref[0, 1]) * (ref[0, 1] - other[0, 1]))
    assert np.isclose(diff["kl_mean"], kl / 8) and diff["kl_p99"] > 0
    assert diff["top1_agree"] == (7 / 8 if np.argmax(ref[0, 1]) != np.argmax(other[0, 1]) else 1.0)
