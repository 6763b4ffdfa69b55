"""What a model family owns: its HF config conversion and the HF names of its tensors.

Every family module (`models/mixtral.py`, `models/qwen3_moe.py`, ...) builds one `FamilySpec` and
registers it; `models/hf.py` looks families up by the `model_type` of a config.json.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from models.config import Family, ModelConfig, RopeScaling, RopeType


@dataclass(frozen=True)
class ExpertNames:
    """HF names of one routed expert's projections in the per-expert layout (relative to the expert)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


@dataclass(frozen=True)
class FamilySpec:
    """A family: HF `model_type`, config converters, and the prefixes its checkpoints use.

    `legacy_moe_prefix` / `legacy_router` / `expert_names` name the per-expert layout that
    `save_pretrained` writes (e.g. Mixtral's `block_sparse_moe.experts.E.w1`); the fused
    transformers-v5 layout always sits under `mlp.experts.{gate_up_proj, down_proj}` with the router
    at `mlp.<fused_router>`.
    """

    family: Family
    model_type: str
    architecture: str
    from_hf: Callable[[dict[str, Any]], ModelConfig]
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    legacy_moe_prefix: str = "mlp"
    legacy_router: str = "gate"
    fused_router: str = "gate"
    expert_names: ExpertNames = ExpertNames()


FAMILIES: dict[Family, FamilySpec] = {}


def register(spec: FamilySpec) -> FamilySpec:
    FAMILIES[spec.family] = spec
    return spec


# ---- helpers shared by the family converters -----------------------------------------------


def require(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ValueError(f"{where}: config.json lacks required key {key!r}")
    return d[key]


def first_of(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The value of the first key present (and not None) among `keys`."""
    for key in keys:
        if d.get(key) is not None:
            return d[key]
    return default


def rope_from_hf(d: dict[str, Any]) -> tuple[float, Optional[RopeScaling]]:
    """(rope_theta, scaling) from either `rope_parameters` (transformers v5) or `rope_theta` + `rope_scaling`."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = dict(params)
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = dict(d.get("rope_scaling") or {})
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("rope_theta", None)
    if kind == "default":
        return theta, None
    try:
        rope_type = RopeType(kind)
    except ValueError:
        raise ValueError(f"config.json: rope scaling type {kind!r} unsupported; "
                         f"supported: {[t.value for t in RopeType]}") from None
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    known = {k: v for k, v in scaling.items() if k in fields and v is not None}
    return theta, RopeScaling(type=rope_type, **known)


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """`rope_parameters` as transformers v5 writes it."""
    params: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    s = cfg.rope_scaling
    if s is not None and s.type is not RopeType.default:
        params["rope_type"] = s.type.value
        for f in dataclasses.fields(RopeScaling):
            value = getattr(s, f.name)
            if f.name != "type" and value is not None:
                params[f.name] = list(value) if isinstance(value, tuple) else value
    return {"rope_parameters": params}


def common_from_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    """The fields every family spells the same way."""
    theta, scaling = rope_from_hf(d)
    return dict(
        vocab_size=int(require(d, "vocab_size", where)),
        hidden_size=int(require(d, "hidden_size", where)),
        num_hidden_layers=int(require(d, "num_hidden_layers", where)),
        num_attention_heads=int(require(d, "num_attention_heads", where)),
        num_key_value_heads=int(first_of(d, "num_key_value_heads", "num_attention_heads")),
        intermediate_size=int(require(d, "intermediate_size", where)),
        num_experts_per_tok=int(require(d, "num_experts_per_tok", where)),
        head_dim=d.get("head_dim"),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=_token_id(d.get("bos_token_id")),
        eos_token_id=_token_id(d.get("eos_token_id")),
        pad_token_id=_token_id(d.get("pad_token_id")),
    )


def _token_id(value: Any) -> Optional[int]:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def common_to_hf(cfg: ModelConfig, spec_model_type: str, architecture: str) -> dict[str, Any]:
    out: dict[str, Any] = dict(
        architectures=[architecture], model_type=spec_model_type, vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, num_experts_per_tok=cfg.num_experts_per_tok,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, hidden_act="silu",
    )
    if cfg.head_dim is not None:
        out["head_dim"] = cfg.head_dim
    out.update(rope_to_hf(cfg))
    return out
