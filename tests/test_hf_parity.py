"""Every family against transformers' implementation of the same name, on tiny random checkpoints.

Prefill logits and KV-cached decode logits within 1e-4; greedy generation token for token equal to
`generate(do_sample=False)` on a batch of three prompts of different lengths (left padded).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.hf_tiny import FAMILIES, hf_model, save_fused
from models.generation import Generator, left_pad
from models.hf import load_hf
from models.transformer import forward_jit as forward, init_cache

SEQ, PREFILL = 20, 14


@pytest.fixture(scope="module", params=FAMILIES)
def family_ckpt(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    model = hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


def _reference_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_prefill_and_cached_decode_match_transformers(family_ckpt) -> None:
    family, hf, folder = family_ckpt
    cfg, model = load_hf(folder)
    tokens = np.random.RandomState(0).randint(3, cfg.vocab_size, (2, SEQ))
    ref = _reference_logits(hf, tokens)
    positions = np.tile(np.arange(SEQ), (2, 1))
    cache = init_cache(model, 2, 32)
    logits, cache, captured = forward(model, jnp.asarray(tokens[:, :PREFILL]), cache,
                                      jnp.asarray(positions[:, :PREFILL]), capture=True)
    np.testing.assert_allclose(np.asarray(logits), ref[:, :PREFILL], atol=1e-4, err_msg=f"{family} prefill")
    assert captured.experts.shape == (len(cfg.moe_layers), 2, PREFILL, cfg.num_experts_per_tok)
    for t in range(PREFILL, SEQ):
        step, cache, _ = forward(model, jnp.asarray(tokens[:, t:t + 1]), cache, jnp.asarray(positions[:, t:t + 1]))
        np.testing.assert_allclose(np.asarray(step)[:, 0], ref[:, t], atol=1e-4, err_msg=f"{family} decode {t}")


def test_greedy_generation_matches_transformers(family_ckpt) -> None:
    family, hf, folder = family_ckpt
    cfg, model = load_hf(folder)
    rs = np.random.RandomState(1)
    prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in (5, 9, 13)]
    tokens, valid = left_pad(prompts, 13, fill=0)
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor(tokens, dtype=torch.long),
                          attention_mask=torch.tensor(valid, dtype=torch.long), do_sample=False,
                          max_new_tokens=10, min_new_tokens=10, pad_token_id=0, eos_token_id=None).numpy()[:, 13:]
    out = Generator(model).generate(prompts, max_new_tokens=10)
    np.testing.assert_array_equal(out.tokens, ref, err_msg=f"{family} greedy generation")


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_fused_v5_layout_loads_like_per_expert(family: str, tmp_path: Path) -> None:
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "legacy")
    save_fused(hf, tmp_path / "fused")
    _, a = load_hf(tmp_path / "legacy")
    _, b = load_hf(tmp_path / "fused")
    tokens = jnp.asarray(np.random.RandomState(2).randint(3, 97, (1, 8)))
    pos = jnp.arange(8)[None]
    la, _, _ = forward(a, tokens, init_cache(a, 1, 8), pos)
    lb, _, _ = forward(b, tokens, init_cache(b, 1, 8), pos)
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
    ref = _reference_logits(hf, np.asarray(tokens))
    np.testing.assert_allclose(np.asarray(lb), ref, atol=1e-4)


def test_sharded_checkpoint_and_bf16(tmp_path: Path) -> None:
    hf = hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _, fp32 = load_hf(tmp_path)
    _, bf16 = load_hf(tmp_path, dtype=jnp.bfloat16)
    assert bf16.embed[...].dtype == jnp.bfloat16
    tokens = np.random.RandomState(3).randint(3, 97, (1, 12))
    pos = jnp.arange(12)[None]
    ref = _reference_logits(hf, tokens)
    l32, _, _ = forward(fp32, jnp.asarray(tokens), init_cache(fp32, 1, 16), pos)
    l16, _, _ = forward(bf16, jnp.asarray(tokens), init_cache(bf16, 1, 16, jnp.bfloat16), pos)
    np.testing.assert_allclose(np.asarray(l32), ref, atol=1e-4)
    assert np.abs(np.asarray(l16) - ref).max() < 0.1 * np.abs(ref).max()


def test_save_hf_round_trips_through_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from models.hf import save_hf

    hf = hf_model("deepseek_v2")
    hf.save_pretrained(tmp_path / "src")
    cfg, model = load_hf(tmp_path / "src")
    save_hf(cfg, model, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = np.random.RandomState(4).randint(3, 97, (2, 10))
    np.testing.assert_allclose(_reference_logits(again, tokens), _reference_logits(hf, tokens), atol=1e-5)
    cfg2, _ = load_hf(tmp_path / "out")
    assert cfg2 == cfg
