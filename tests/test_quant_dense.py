"""Dense projections kept in a GGUF file's blocks (`model.dense_format=blocks`, models.quant.dense): `QuantLinear`
against "round the activations as llama.cpp does, dequantize, f32 matmul" (`native.qlinear_reference`) over random
shapes and row parts of mixed types, and the loader's choice and placement of the blocks (each kept matrix equal,
dequantized, to what `dense_format=dequantize` loads; Mixtral's rope row order included)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.bench.peers.to_gguf import convert
from models import native
from models.quant.blocks import QuantArray
from models.quant.dense import EmbedBlocks, QuantLinear, dense_blocks_of
from tests.test_native_quant import bound

pytestmark = pytest.mark.skipif(not native.available_experts(), reason="native FFI kernels unavailable")


def test_quant_linear_equals_the_reference_over_random_shapes() -> None:
    """Row parts of different types (as Q4_K_M's q, k Q4_K and v Q6_K), with and without a bias, bf16 and f32
    activations, 1-9 rows: each output within f32 summation error of the reference."""
    rng = np.random.default_rng(0)
    for trial, types in enumerate((("q4_k", "q4_k", "q6_k"), ("q8_0",), ("q4_0", "q8_0"), ("q6_k",))):
        K = 256 * int(rng.integers(1, 4))
        parts = [native.random_blocks(rng, t, int(rng.integers(1, 50)), K) for t in types]
        N = sum(p.shape[0] for p in parts)
        bias = nnx.Param(jnp.asarray(rng.standard_normal(N).astype(np.float32))) if trial % 2 else None
        layer = QuantLinear([p for p in parts], bias)
        assert layer.shape == (N, K)
        M = int(rng.integers(1, 10))
        x = rng.standard_normal((M, K)).astype(np.float32)
        y = np.asarray(jax.jit(lambda x: layer(x))(jnp.asarray(x)))
        ref = np.concatenate([native.qlinear_reference(x, p) for p in parts], axis=1)
        tol = np.concatenate([bound(x, p) for p in parts], axis=1)
        if bias is not None:
            ref = ref + np.asarray(bias[...])
            tol = tol + 1e-6 * np.abs(ref)
        assert y.shape == (M, N)
        assert np.all(np.abs(y - ref) <= tol), (types, np.abs(y - ref).max())
        yb = np.asarray(layer(jnp.asarray(x, jnp.bfloat16)))  # bf16 activations: bf16 out, sums rounded once
        assert yb.dtype == jnp.bfloat16


def _weight(model, path) -> np.ndarray:
    node = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    if isinstance(node, QuantLinear):
        return np.concatenate([native.dequantize(q) for q in node.quant_parts])
    return np.asarray(node.weight[...], np.float32)


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """family -> its tiny HF checkpoint folder, written on first use."""
    from tests.hf_tiny import hf_model

    root = tmp_path_factory.mktemp("dense_blocks")

    def folder(family: str):
        if not (root / family / "config.json").is_file():
            hf_model(family).save_pretrained(root / family)
        return root / family

    return folder


def _load_both(tiny_folders, family: str):
    from models.loading import load_model

    path = tiny_folders(family) / "q8-matrices.gguf"
    if not path.is_file():
        convert(tiny_folders(family), path, dense="f32", matrices="q8_0")
    spec = {"name": "tiny", "checkpoint": str(path)}
    cfg, kept, _ = load_model({**spec, "dense_format": "blocks"})
    _, plain, _ = load_model({**spec, "dense_format": "dequantize"})
    return cfg, kept, plain


def test_gguf_dense_in_blocks(tiny_folders) -> None:
    """A Mixtral file whose attention and LM head are Q8_0: `blocks` keeps them as QuantLinear, each the same matrix
    `dequantize` loads, bit for bit once dequantized (q/k rows back in HF's rope order); the LM head's logits within
    the reference's tolerance; the offload executor's model (`without_experts`) shares the blocks."""
    from models.transformer import without_experts

    cfg, kept, plain = _load_both(tiny_folders, "mixtral")
    slots = {(a if p is kept else "attn." + a) for p, a in dense_blocks_of(kept)}
    assert slots == {"lm_head", "attn.qkv", "attn.o"}
    for i in range(cfg.num_hidden_layers):
        for name in ("qkv", "o"):
            np.testing.assert_array_equal(_weight(kept, ("layers", i, "attn", name)),
                                          _weight(plain, ("layers", i, "attn", name)))
    np.testing.assert_array_equal(_weight(kept, ("lm_head",)), _weight(plain, ("lm_head",)))
    assert isinstance(kept.embed, EmbedBlocks) and kept.run_dtype == plain.embed[...].dtype  # rows looked up in blocks
    np.testing.assert_array_equal(np.asarray(kept.embed_tokens(jnp.asarray([[0, 5], [96, 3]]))),
                                  np.asarray(plain.embed[...])[np.array([[0, 5], [96, 3]])])
    h = np.random.default_rng(1).standard_normal((3, cfg.hidden_size)).astype(np.float32)
    head = kept.lm_head
    got = np.asarray(jax.jit(lambda h: head(h))(jnp.asarray(h)))
    (w,) = head.quant_parts
    assert np.all(np.abs(got - native.qlinear_reference(h, QuantArray(np.asarray(w.data), w.qtype, w.shape)))
                  <= bound(h, QuantArray(np.asarray(w.data), w.qtype, w.shape)))
    lean = without_experts(kept)
    assert len(dense_blocks_of(lean)) == len(dense_blocks_of(kept))
    assert dense_blocks_of(lean)[0][0].qkv.parts[0][...] is dense_blocks_of(kept)[0][0].qkv.parts[0][...]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "phimoe"])
def test_gguf_dense_in_blocks_forward(tiny_folders, family) -> None:
    """The whole forward pass with the blocks kept: logits within Q8 activation rounding of `dequantize`'s; Qwen3's
    o_proj (rows of 48, not whole Q8_0 blocks) stays dequantized, PhiMoE's biases stay with their projections."""
    from models.transformer import forward, forward_jit, init_cache

    cfg, kept, plain = _load_both(tiny_folders, family)
    slots = {(a if p is kept else "attn." + a) for p, a in dense_blocks_of(kept)}
    assert "lm_head" in slots and "attn.qkv" in slots
    assert ("attn.o" in slots) == (family != "qwen3_moe")
    tokens = jnp.asarray(np.arange(3, 13, dtype=np.int32).reshape(2, 5))
    pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    out = [np.asarray(f(m, tokens, init_cache(m, 2, 8, jnp.float32), pos)[0])  # eager FFI calls compile slowly: jit
           for f, m in ((forward_jit, kept), (forward, plain))]
    scale = np.abs(out[1]).max()
    assert 0 < np.abs(out[0] - out[1]).max() <= 0.05 * scale  # the Q8 activation rounding is there, and only it


def test_dense_format_names_the_key() -> None:
    from models.loading import dense_blocks

    with pytest.raises(ValueError, match=r"model.dense_format='bf16' is not supported; supported: blocks, dequantize"):
        dense_blocks({"name": "x", "dense_format": "bf16"}, None)
    assert dense_blocks({"name": "x", "dense_format": "dequantize"}, None) == {}


def _swiglu_weights(model, path) -> tuple[np.ndarray, np.ndarray]:
    from models.quant.dense import QuantSwiGLU

    node = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    if isinstance(node, QuantSwiGLU):
        return tuple(np.concatenate([native.dequantize(q) for q in part.quant_parts]) for part in (node.gate_up, node.down))
    return np.asarray(node.gate_up[...], np.float32), np.asarray(node.down[...], np.float32)


@pytest.mark.slow
def test_gguf_swiglu_mlps_in_blocks(tmp_path) -> None:
    """A DeepSeek-V2 file whose matrices are Q8_0: `blocks` keeps the dense layer's MLP and every layer's shared
    experts as `QuantSwiGLU` (gate and up as row parts of one projection, down another), each matrix the one
    `dequantize` loads once dequantized; the offload executor's model shares them; the whole forward pass stays within
    Q8 activation rounding of `dequantize`'s."""
    from transformers import AutoModelForCausalLM

    from models.loading import load_model
    from models.quant.dense import EmbedBlocks, QuantSwiGLU
    from models.transformer import forward_jit, init_cache, without_experts
    from tests.hf_tiny import hf_config

    hf = hf_config("deepseek_v2")  # widths of whole Q8_0 blocks: the dense MLP's 64, the shared experts' 2 x 16
    hf.intermediate_size, hf.moe_intermediate_size = 64, 16
    folder = tmp_path / "hf"
    AutoModelForCausalLM.from_config(hf).save_pretrained(folder)
    convert(folder, tmp_path / "q8.gguf", dense="f32", matrices="q8_0")
    spec = {"name": "tiny", "checkpoint": str(tmp_path / "q8.gguf")}
    cfg, kept, _ = load_model({**spec, "dense_format": "blocks"})
    _, plain, _ = load_model({**spec, "dense_format": "dequantize"})
    paths = [("layers", i, "mlp") for i in range(cfg.num_hidden_layers) if i not in cfg.moe_layers]
    paths += [("layers", i, "moe", "shared") for i in cfg.moe_layers]
    assert len(paths) == cfg.num_hidden_layers and cfg.n_shared_experts
    for path in paths:
        for got, want in zip(_swiglu_weights(kept, path), _swiglu_weights(plain, path)):
            np.testing.assert_array_equal(got, want)
    assert isinstance(kept.embed, EmbedBlocks)  # looked up row by row, each row the one `dequantize` stores
    np.testing.assert_array_equal(np.asarray(kept.embedding()), np.asarray(plain.embed[...]))
    lean = without_experts(kept)
    assert isinstance(lean.layers[cfg.moe_layers[0]].moe.shared, QuantSwiGLU) and isinstance(lean.embed, EmbedBlocks)
    assert lean.layers[0].mlp.down.parts[0][...] is kept.layers[0].mlp.down.parts[0][...]
    tokens = jnp.asarray(np.arange(3, 13, dtype=np.int32).reshape(2, 5))
    pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    out = [np.asarray(forward_jit(m, tokens, init_cache(m, 2, 8, jnp.float32), pos)[0]) for m in (kept, plain)]
    assert 0 < np.abs(out[0] - out[1]).max() <= 0.05 * np.abs(out[1]).max()
