"""Qwen3-MoE (Qwen/Qwen3-30B-A3B): GQA with per-head q/k RMSNorm, many small experts, `norm_topk_prob`,
dense layers by `decoder_sparse_step` / `mlp_only_layers`."""

from __future__ import annotations

from typing import Any

from models.config import Family, ModelConfig, QKNorm
from models.family import FamilySpec, common_from_hf, common_to_hf, first_of, register, require


def from_hf(d: dict[str, Any]) -> ModelConfig:
    where = "qwen3_moe config"
    return ModelConfig(
        family=Family.qwen3_moe, **common_from_hf(d, where),
        num_experts=int(first_of(d, "num_experts", "num_local_experts") or require(d, "num_experts", where)),
        moe_intermediate_size=int(require(d, "moe_intermediate_size", where)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
        mlp_only_layers=list(d.get("mlp_only_layers") or []),
        qk_norm=QKNorm.per_head,
        attention_bias=bool(d.get("attention_bias", False)),
        sliding_window=d.get("sliding_window") if d.get("use_sliding_window", False) else None,
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = common_to_hf(cfg, SPEC.model_type, SPEC.architecture)
    out.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.expert_intermediate_size,
               norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
               mlp_only_layers=list(cfg.mlp_only_layers), attention_bias=cfg.attention_bias,
               use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
               router_aux_loss_coef=0.0, output_router_logits=False)
    return out


SPEC = register(FamilySpec(family=Family.qwen3_moe, model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
                           from_hf=from_hf, to_hf=to_hf))
