"""Tiny random transformers checkpoints of every family, configured to exercise each family's special paths.

The reference implementations are transformers' own (PyTorch); weights are perturbed away from
their initialisation (norms, biases, DeepSeek-V3's score-correction bias) so that every parameter
matters to the output.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "phimoe")


def hf_config(family: str):
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=12)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, head_dim=12,
                                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    if family == "olmoe":
        return tf.OlmoeConfig(**common, num_experts=8, num_experts_per_tok=2, clip_qkv=0.6, norm_topk_prob=False)
    mla = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, moe_intermediate_size=12,
               n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1,
               n_group=4, topk_group=2)
    common_mla = {**common, "num_key_value_heads": 4}
    if family == "deepseek_v2":
        return tf.DeepseekV2Config(**common_mla, **mla, q_lora_rank=None, topk_method="group_limited_greedy",
                                   routed_scaling_factor=1.5,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(**common_mla, **mla, q_lora_rank=16, routed_scaling_factor=2.5,
                                   norm_topk_prob=True, rope_interleave=True)
    if family == "phimoe":
        half = 4  # head_dim 8 -> 4 rotary frequencies
        return tf.PhimoeConfig(**common, num_local_experts=4, num_experts_per_tok=2, attention_bias=True,
                               lm_head_bias=True, router_jitter_noise=0.01,
                               rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                "original_max_position_embeddings": 64,
                                                "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                                "long_factor": [2.0 + 0.5 * i for i in range(half)],
                                                "short_mscale": 1.1, "long_mscale": 1.2})
    raise KeyError(family)


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised transformers model in eval mode, parameters perturbed (deterministic)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.08 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


def save_fused(model: torch.nn.Module, folder: Path) -> Path:
    """Write the transformers-v5 fused layout (the in-memory state dict) as one safetensors file."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)  # config.json (and a per-expert file we replace)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((folder / "config.json").read_text())["model_type"]
    return folder
