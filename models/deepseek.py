"""DeepSeek-V2 (V2-Lite) and DeepSeek-V3 (as used by Moonlight-16B-A3B): multi-head latent attention,
shared experts, dense first layers.

V2 routes by softmax top-k (optionally group-limited) and, as transformers' implementation does,
never renormalises the chosen weights; its rotary embedding acts on interleaved pairs. V3 scores
by sigmoid, chooses with `e_score_correction_bias` inside the best `topk_group` of `n_group` groups
(group score: sum of the group's top two), renormalises when `norm_topk_prob`, and scales by
`routed_scaling_factor`.
"""

from __future__ import annotations

from typing import Any

from models.config import Family, ModelConfig, ScoringFunc, TopkMethod
from models.family import FamilySpec, common_from_hf, common_to_hf, first_of, register, require


def _shared(d: dict[str, Any], where: str) -> dict[str, Any]:
    common = common_from_hf(d, where)
    common["head_dim"] = None  # MLA head sizes come from the qk_*/v_head_dim keys
    q_lora = d.get("q_lora_rank")
    return dict(
        **common,
        num_experts=int(first_of(d, "n_routed_experts", "num_experts") or require(d, "n_routed_experts", where)),
        moe_intermediate_size=int(require(d, "moe_intermediate_size", where)),
        n_shared_experts=int(d.get("n_shared_experts") or 0),
        first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
        n_group=int(d.get("n_group") or 1),
        topk_group=int(d.get("topk_group") or 1),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        kv_lora_rank=int(require(d, "kv_lora_rank", where)),
        q_lora_rank=None if q_lora is None else int(q_lora),
        qk_nope_head_dim=int(require(d, "qk_nope_head_dim", where)),
        qk_rope_head_dim=int(require(d, "qk_rope_head_dim", where)),
        v_head_dim=int(require(d, "v_head_dim", where)),
        attention_bias=bool(d.get("attention_bias", False)),
    )


def v2_from_hf(d: dict[str, Any]) -> ModelConfig:
    method = d.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"deepseek_v2 config: topk_method {method!r} unsupported (greedy, group_limited_greedy)")
    return ModelConfig(family=Family.deepseek_v2, **_shared(d, "deepseek_v2 config"),
                       scoring_func=ScoringFunc.softmax, topk_method=TopkMethod(method),
                       norm_topk_prob=False, rope_interleave=True)


def v3_from_hf(d: dict[str, Any]) -> ModelConfig:
    return ModelConfig(family=Family.deepseek_v3, **_shared(d, "deepseek_v3 config"),
                       scoring_func=ScoringFunc.sigmoid, topk_method=TopkMethod.noaux_tc,
                       norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                       rope_interleave=bool(d.get("rope_interleave", True)))


def _to_hf(cfg: ModelConfig, spec: FamilySpec) -> dict[str, Any]:
    out = common_to_hf(cfg, spec.model_type, spec.architecture)
    out.pop("head_dim", None)
    out.update(n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.expert_intermediate_size,
               n_shared_experts=cfg.n_shared_experts, first_k_dense_replace=cfg.first_k_dense_replace,
               n_group=cfg.n_group, topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
               kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
               qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim,
               attention_bias=cfg.attention_bias, norm_topk_prob=cfg.norm_topk_prob, output_router_logits=False)
    if cfg.family is Family.deepseek_v2:
        out["topk_method"] = cfg.topk_method.value
    else:
        out.update(topk_method="noaux_tc", rope_interleave=cfg.rope_interleave, num_nextn_predict_layers=0)
    return out


V2 = register(FamilySpec(family=Family.deepseek_v2, model_type="deepseek_v2", architecture="DeepseekV2ForCausalLM",
                         from_hf=v2_from_hf, to_hf=lambda cfg: _to_hf(cfg, V2)))
V3 = register(FamilySpec(family=Family.deepseek_v3, model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM",
                         from_hf=v3_from_hf, to_hf=lambda cfg: _to_hf(cfg, V3)))
