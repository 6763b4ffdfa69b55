"""Resolve a Hydra model spec into a `ModelConfig` (from its `arch`, its checkpoint, or both)."""

from __future__ import annotations

import json
from typing import Any

from conf import resolve_path, to_frozen
from models.config import ModelConfig


def resolve_model_config(spec: Any) -> ModelConfig:
    """The architecture of a `model` config node; a checkpoint's config.json must agree with `arch`."""
    arch = spec.get("arch") if hasattr(spec, "get") else getattr(spec, "arch", None)
    ckpt = spec.get("checkpoint") if hasattr(spec, "get") else getattr(spec, "checkpoint", None)
    from_arch = to_frozen(arch, ModelConfig) if arch is not None else None
    if ckpt is None:
        if from_arch is None:
            raise ValueError("model: set model.arch or model.checkpoint")
        return from_arch
    from models.hf import config_from_hf

    path = resolve_path(ckpt) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model.checkpoint: {path} not found")
    from_ckpt = config_from_hf(json.loads(path.read_text()), where=str(path))
    if from_arch is not None and from_arch != from_ckpt:
        diff = [f for f in from_ckpt.__dataclass_fields__ if getattr(from_arch, f) != getattr(from_ckpt, f)]
        raise ValueError(f"model.arch disagrees with {path} on {diff}")
    return from_ckpt
