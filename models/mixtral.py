"""Mixtral (mistralai/Mixtral-8x7B): GQA, softmax top-k routing renormalised over the chosen experts."""

from __future__ import annotations

from typing import Any

from models.config import Family, ModelConfig
from models.family import ExpertNames, FamilySpec, common_from_hf, common_to_hf, first_of, register, require


def from_hf(d: dict[str, Any]) -> ModelConfig:
    where = "mixtral config"
    return ModelConfig(
        family=Family.mixtral, **common_from_hf(d, where),
        num_experts=int(first_of(d, "num_local_experts", "num_experts") or require(d, "num_local_experts", where)),
        norm_topk_prob=True,  # transformers' Mixtral router always renormalises the top-k weights
        sliding_window=d.get("sliding_window"),
        router_jitter_noise=float(d.get("router_jitter_noise", 0.0)),
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = common_to_hf(cfg, SPEC.model_type, SPEC.architecture)
    out.update(num_local_experts=cfg.num_experts, sliding_window=cfg.sliding_window,
               router_jitter_noise=cfg.router_jitter_noise, router_aux_loss_coef=0.0, output_router_logits=False)
    return out


SPEC = register(FamilySpec(family=Family.mixtral, model_type="mixtral", architecture="MixtralForCausalLM",
                           from_hf=from_hf, to_hf=to_hf, legacy_moe_prefix="block_sparse_moe",
                           expert_names=ExpertNames(gate="w1", up="w3", down="w2")))
