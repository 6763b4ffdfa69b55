"""PhiMoE (microsoft/Phi-3.5-MoE): LayerNorm with bias, attention and LM-head biases, sparsemixer
top-2 routing (`models.moe.sparsemixer_route`), long-rope scaling.

Long-rope: beyond `original_max_position_embeddings` we switch to the long factors, as the
original implementation does; transformers v5's PhiMoE keeps the short factors and switches only
the magnitude scale (identical for Phi-3.5-MoE), so the two differ only past 4096 tokens.
"""

from __future__ import annotations

from typing import Any

from models.config import Family, ModelConfig, NormKind, ScoringFunc
from models.family import ExpertNames, FamilySpec, common_from_hf, common_to_hf, first_of, register, require


def from_hf(d: dict[str, Any]) -> ModelConfig:
    where = "phimoe config"
    return ModelConfig(
        family=Family.phimoe, **common_from_hf(d, where),
        num_experts=int(first_of(d, "num_local_experts", "num_experts") or require(d, "num_local_experts", where)),
        scoring_func=ScoringFunc.sparsemixer,
        norm=NormKind.layernorm,
        attention_bias=bool(d.get("attention_bias", False)),
        lm_head_bias=bool(d.get("lm_head_bias", False)),
        router_jitter_noise=float(d.get("router_jitter_noise", 0.01)),
        input_jitter_noise=float(d.get("input_jitter_noise", 0.0)),
        sliding_window=d.get("sliding_window"),
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = common_to_hf(cfg, SPEC.model_type, SPEC.architecture)
    out.update(num_local_experts=cfg.num_experts, attention_bias=cfg.attention_bias, lm_head_bias=cfg.lm_head_bias,
               router_jitter_noise=cfg.router_jitter_noise, input_jitter_noise=cfg.input_jitter_noise,
               sliding_window=cfg.sliding_window, router_aux_loss_coef=0.0, output_router_logits=False)
    return out


SPEC = register(FamilySpec(family=Family.phimoe, model_type="phimoe", architecture="PhimoeForCausalLM",
                           from_hf=from_hf, to_hf=to_hf, legacy_moe_prefix="block_sparse_moe",
                           fused_router="router", expert_names=ExpertNames(gate="w1", up="w3", down="w2")))
