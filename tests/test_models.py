"""Model shapes at paper scale (nothing allocated), tiny configs of every family, generation semantics, bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conf import compose
from models.config import Family
from models.generation import Generator, SamplingParams, left_pad
from models.hf import CheckpointError, load_hf
from models.loading import resolve_model_config
from models.layers import attention_masks, sdpa
from models.transformer import KVCache, attention_inputs, build_model, count_params, forward_jit, init_cache
from tests.hf_tiny import hf_model

MiB = 2 ** 20


def _model_cfg(name: str):
    return resolve_model_config(compose("generate", [f"model={name}"]).model)


@pytest.mark.parametrize("name, published", [("mixtral_8x7b", 46.7e9), ("qwen3_30b_a3b", 30.5e9),
                                             ("deepseek_v2_lite", 15.7e9), ("moonlight_16b_a3b", 16.0e9),
                                             ("phi35_moe", 41.9e9)])
def test_paper_scale_parameter_counts(name: str, published: float) -> None:
    if not (Path(__file__).parents[1] / "conf" / "model" / f"{name}.yaml").is_file():
        pytest.fail(f"conf/model/{name}.yaml missing")
    total = count_params(_model_cfg(name))
    assert abs(total - published) / published < 0.02, f"{name}: {total / 1e9:.2f}B vs published {published / 1e9}B"


@pytest.mark.parametrize("name, mib", [("mixtral_8x7b", 336.0), ("qwen3_30b_a3b", 9.0), ("deepseek_v2_lite", 16.5),
                                       ("moonlight_16b_a3b", 16.5)])
def test_expert_bytes_match_layerscope_table3(name: str, mib: float) -> None:
    assert _model_cfg(name).expert_bytes(2) / MiB == pytest.approx(mib, rel=1e-3)


TINY = ["tiny_mixtral", "tiny_qwen3_moe", "tiny_olmoe", "tiny_deepseek_v2", "tiny_moonlight", "tiny_phimoe"]


@pytest.mark.parametrize("name", TINY)
def test_tiny_configs_run_and_capture_routing(name: str) -> None:
    cfg = _model_cfg(name)
    model = build_model(cfg, seed=0)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 6)))
    logits, cache, cap = forward_jit(model, tokens, init_cache(model, 2, 8), jnp.arange(6)[None].repeat(2, 0),
                                     capture=True, capture_hidden=True)
    assert logits.shape == (2, 6, cfg.vocab_size) and np.isfinite(np.asarray(logits)).all()
    L, k = len(cfg.moe_layers), cfg.num_experts_per_tok
    assert cap.experts.shape == (L, 2, 6, k) and cap.hidden.shape == (L, 2, 6, cfg.hidden_size)
    experts = np.asarray(cap.experts)
    assert experts.min() >= 0 and experts.max() < cfg.num_experts
    # top-k picks distinct experts per token
    assert (np.sort(experts, axis=-1)[..., 1:] != np.sort(experts, axis=-1)[..., :-1]).all()
    assert int(cache.index) == 6


def test_seeded_sampling_is_reproducible_and_top_p_restricts() -> None:
    cfg = _model_cfg("tiny_mixtral")
    gen = Generator(build_model(cfg, seed=0))
    prompts = [[5, 6, 7, 8]] * 3
    a = gen.generate(prompts, 12, SamplingParams(temperature=1.0, top_p=0.9, seed=7)).tokens
    b = gen.generate(prompts, 12, SamplingParams(temperature=1.0, top_p=0.9, seed=7)).tokens
    c = gen.generate(prompts, 12, SamplingParams(temperature=1.0, top_p=0.9, seed=8)).tokens
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    greedy = gen.generate(prompts, 12).tokens
    tiny_p = gen.generate(prompts, 12, SamplingParams(temperature=1.0, top_p=1e-6, seed=3)).tokens
    np.testing.assert_array_equal(tiny_p, greedy)  # a nucleus of one token is greedy


def test_generation_stops_rows_at_eos() -> None:
    cfg = _model_cfg("tiny_mixtral")
    gen = Generator(build_model(cfg, seed=0))
    free = gen.generate([[9, 10, 11], [12, 13]], 8).tokens
    # EOS := the first token of row 0 not generated before it, so row 0 must stop right there
    stop = next(i for i in range(1, 8) if free[0, i] not in free[0, :i])
    eos = int(free[0, stop])
    out = gen.generate([[9, 10, 11], [12, 13]], 8, eos_token_id=eos, pad_token_id=0)
    assert out.lengths[0] == stop + 1 and (out.tokens[0, stop + 1:] == 0).all()
    np.testing.assert_array_equal(out.tokens[0, :stop + 1], free[0, :stop + 1])
    row1_stop = out.lengths[1]
    np.testing.assert_array_equal(out.tokens[1, :row1_stop], free[1, :row1_stop])


# ---- bad input ------------------------------------------------------------------------------------


def test_prompt_longer_than_context_is_an_error() -> None:
    cfg = _model_cfg("tiny_mixtral")
    gen = Generator(build_model(cfg))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        gen.generate([[1] * (cfg.max_position_embeddings - 4)], 8)


def test_empty_batch_and_empty_prompt_are_errors() -> None:
    gen = Generator(build_model(_model_cfg("tiny_mixtral")))
    with pytest.raises(ValueError, match="empty batch"):
        gen.generate([], 4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        gen.generate([[1, 2], []], 4)


def test_checkpoint_disagreeing_with_its_config_names_the_tensor(tmp_path: Path) -> None:
    hf_model("mixtral").save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    d = json.loads(cfg_path.read_text())
    d["intermediate_size"] = 48
    cfg_path.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"block_sparse_moe\.experts\.0\.w1\.weight has shape \[40, 32\], expected \[48, 32\]"):
        load_hf(tmp_path)


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    hf_model("olmoe").save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = tensors.pop("model.layers.2.self_attn.k_norm.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_hf(tmp_path)
    assert "missing tensor model.layers.2.self_attn.k_norm.weight (expected shape [16])" in str(err.value)
    assert "unexpected tensor model.layers.0.mlp.extra.weight" in str(err.value)


def test_unknown_family_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(CheckpointError, match="unknown model family model_type='gpt2'"):
        load_hf(tmp_path)


def test_model_arch_disagreeing_with_checkpoint_is_an_error(tmp_path: Path) -> None:
    hf_model("mixtral").save_pretrained(tmp_path)
    spec = compose("generate", ["model=tiny_mixtral", f"model.checkpoint={tmp_path}"]).model
    with pytest.raises(ValueError, match="model.arch disagrees"):
        resolve_model_config(spec)


def test_family_enum_covers_every_registered_converter() -> None:
    from models.family import FAMILIES
    from models import hf  # noqa: F401  (registers)

    assert set(FAMILIES) == set(Family) - {Family.llama4}


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_into_an_empty_cache_skips_the_cache_scores_with_the_same_bits(window) -> None:
    """`sdpa(..., empty_cache=True)` (what `Generator`'s prefill runs: `forward(..., empty_cache=True)` into a fresh
    cache) leaves the cache's score blocks out (two dot products fewer: half the attention's dot work and XLA temp at
    256 tokens) and gives the same bits as attending the all-masked cache: bf16, GQA (8 query heads over 2), two
    left-padded rows, the masks of a fresh cache's `attention_inputs`, with and without a sliding window. (Also
    checked on the 1-layer Mixtral-width Q4_K_M GGUF's whole prefill logits: max |diff| 0.) Mutations that fail it:
    `sdpa` ignoring the flag (the dots stay), the new-token softmax without its mask."""
    cfg = dataclasses.replace(_model_cfg("tiny_mixtral"), sliding_window=window)
    rng = np.random.default_rng(3)
    B, S, C, Hq, Hkv, D = 2, 16, 64, 8, 2, 16
    _, valid = left_pad([[1] * 13, [1] * 4], S, 0)
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    cache = KVCache(layers=[], valid=jnp.zeros((B, C), bool), positions=jnp.zeros((B, C), jnp.int32),
                    index=jnp.int32(0))
    ai, _ = attention_inputs(cfg, cache, jnp.asarray(positions), jnp.asarray(valid))
    masks = attention_masks(ai, window)
    q, kn, vn = (jnp.asarray(rng.standard_normal((B, S, h, D)), jnp.bfloat16) for h in (Hq, Hkv, Hkv))
    kc = vc = jnp.zeros((B, Hkv, C, D), jnp.bfloat16)
    run = [jax.jit(lambda *a, e=e: sdpa(*a, masks, D ** -0.5, e)) for e in (False, True)]
    outs = [np.asarray(f(q, kc, vc, kn, vn).astype(jnp.float32)) for f in run]
    np.testing.assert_array_equal(outs[1], outs[0])
    dots = [f.lower(q, kc, vc, kn, vn).as_text().count("dot_general") for f in run]
    assert dots == [4, 2], dots
