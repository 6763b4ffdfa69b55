"""Random real-width checkpoints (engine/bench/real_width.py): transformers loads them with every parameter
matched, in both layouts, and their config.json reads back as the config they were written from.

Hidden, attention and expert widths are the released models'; depth, expert count and vocabulary are cut
so that each family's pair of checkpoints stays under ~1 GB and the module runs in well under a minute.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.bench.real_width import (checkpoint_bytes, cached_checkpoint, real_width_config, tensor_specs,
                                     write_random_checkpoint, write_speed)
from models.hf import read_config

SMALL = dict(vocab_size=8192, bos_token_id=1, eos_token_id=2)
VARIANTS = {
    # Qwen3-30B-A3B width: one MoE layer of 8 of its 2048x768 experts
    "qwen3_moe": dict(num_layers=1, num_experts=8, **SMALL),
    # DeepSeek-V2-Lite width: its dense first layer + one MoE layer (MLA, 2 shared experts)
    "deepseek_v2": dict(num_layers=2, num_experts=8, **SMALL),
    # Mixtral-8x7B width: one layer of 2 of its 4096x14336 experts
    "mixtral": dict(num_layers=1, num_experts=2, **SMALL),
}


def _small(family: str):
    v = dict(VARIANTS[family])
    return real_width_config(family, v.pop("num_layers"), **v)


@pytest.mark.parametrize("family", sorted(VARIANTS))
def test_transformers_loads_both_layouts(family, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _small(family)
    assert cfg.moe_layers, "the variant must keep a MoE layer"
    ids = torch.tensor([[3, 17, 300, 1000, 4000, 7]])
    logits = {}
    for layout in ("per_expert", "fused"):
        folder = write_random_checkpoint(cfg, tmp_path / layout, layout=layout, shards=3)
        assert read_config(folder) == cfg
        config = json.loads((folder / "config.json").read_text())
        assert config["torch_dtype"] == config["dtype"] == "bfloat16"
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        specs = tensor_specs(cfg, layout)
        assert sorted(index["weight_map"]) == sorted(s.name for s in specs)
        assert index["metadata"]["total_size"] == sum(s.nbytes for s in specs)
        assert len(set(index["weight_map"].values())) == 3
        assert (folder / "tokenizer.json").is_file()
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, output_loading_info=True)
        for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            assert not info.get(key), f"{family} {layout}: {key} {sorted(info[key])[:8]}"
        # bf16 throughout, but for what transformers keeps in fp32 on purpose (DeepSeek's router)
        bf16 = sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
        assert bf16 > 0.99 * sum(p.numel() for p in model.parameters())
        with torch.no_grad():
            out = model(ids).logits.float()
        assert torch.isfinite(out).all() and 0.1 < float(out.std()) < 100
        logits[layout] = out
        del model
    # one seed, one model: the fused layout holds the per-expert layout's weights
    assert torch.equal(logits["per_expert"], logits["fused"])


def test_weights_are_distinct_and_plausible(tmp_path):
    import torch
    from safetensors.torch import load_file as load_torch

    cfg = _small("qwen3_moe")
    folder = write_random_checkpoint(cfg, tmp_path / "ckpt", layout="per_expert", shards=2, tokenizer=False)
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_torch(str(f)))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    experts = [tensors[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in range(cfg.num_experts)]
    raw = [e.view(torch.int16).numpy() for e in experts]
    for i in range(len(raw)):
        for j in range(i + 1, len(raw)):
            assert not np.array_equal(raw[i], raw[j])
    w = experts[0].float()
    assert abs(float(w.std()) - 0.02) < 0.002 and abs(float(w.mean())) < 1e-3
    # no period inside a large tensor: its first and second halves differ everywhere but by chance
    emb = tensors["model.embed_tokens.weight"].view(torch.int16).numpy().ravel()
    half = emb.size // 2
    assert float(np.mean(emb[:half] == emb[half:2 * half])) < 0.05
    assert torch.equal(tensors["model.layers.0.input_layernorm.weight"].float(), torch.ones(cfg.hidden_size))
    assert not (folder / "tokenizer.json").exists()
    assert checkpoint_bytes(folder) >= sum(s.nbytes for s in tensor_specs(cfg, "per_expert"))


def test_cached_checkpoint_reuses_complete_folder(tmp_path):
    cfg = real_width_config("qwen3_moe", 1, num_experts=2, vocab_size=1024, bos_token_id=1, eos_token_id=2)
    folder = cached_checkpoint("q", cfg, tmp_path)
    assert write_speed(folder) is not None
    stamp = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.safetensors")}
    assert cached_checkpoint("q", cfg, tmp_path) == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("*.safetensors")} == stamp
    # a different config (or an unfinished folder) is rebuilt
    other = real_width_config("qwen3_moe", 1, num_experts=3, vocab_size=1024, bos_token_id=1, eos_token_id=2)
    assert read_config(cached_checkpoint("q", other, tmp_path)) == other
