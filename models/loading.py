"""Resolve a Hydra model spec into a `ModelConfig` (from its `arch`, its checkpoint, or both)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from conf import resolve_path, to_frozen
from models.config import ModelConfig

if TYPE_CHECKING:
    from models.transformer import MoETransformer


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


def load_model(spec: Any, dtype: Any = None, seed: int = 0, with_experts: bool = True
               ) -> tuple[ModelConfig, "MoETransformer", Optional[Path]]:
    """The model a `model` config node names: its checkpoint (HF folder) or random weights of its `arch`.

    Returns (config, model, checkpoint folder or None).
    """
    import jax.numpy as jnp

    from models.hf import load_hf
    from models.transformer import build_model

    dtype = dtype or jnp.float32
    cfg = resolve_model_config(spec)
    ckpt = spec.get("checkpoint") if hasattr(spec, "get") else getattr(spec, "checkpoint", None)
    if ckpt is None:
        return cfg, build_model(cfg, seed=seed, dtype=dtype, with_experts=with_experts), None
    folder = resolve_path(ckpt)
    _, model = load_hf(folder, dtype=dtype, with_experts=with_experts)
    return cfg, model, folder


def load_tokenizer(folder: Optional[Path]) -> Any:
    """The `tokenizers.Tokenizer` saved next to a checkpoint (tokenizer.json), or None."""
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
