"""OLMoE (allenai/OLMoE-1B-7B): RMSNorm over the whole q and k projections, optional qkv clipping."""

from __future__ import annotations

from typing import Any

from models.config import Family, ModelConfig, QKNorm
from models.family import FamilySpec, common_from_hf, common_to_hf, first_of, register, require


def from_hf(d: dict[str, Any]) -> ModelConfig:
    where = "olmoe config"
    return ModelConfig(
        family=Family.olmoe, **common_from_hf(d, where),
        num_experts=int(first_of(d, "num_experts", "num_local_experts") or require(d, "num_experts", where)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        qk_norm=QKNorm.full,
        clip_qkv=d.get("clip_qkv"),
        attention_bias=bool(d.get("attention_bias", False)),
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = common_to_hf(cfg, SPEC.model_type, SPEC.architecture)
    out.update(num_experts=cfg.num_experts, norm_topk_prob=cfg.norm_topk_prob, clip_qkv=cfg.clip_qkv,
               attention_bias=cfg.attention_bias, router_aux_loss_coef=0.0, output_router_logits=False)
    return out


SPEC = register(FamilySpec(family=Family.olmoe, model_type="olmoe", architecture="OlmoeForCausalLM",
                           from_hf=from_hf, to_hf=to_hf))
