"""Schemas shared by every task: wandb, the model group, numeric precision."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from conf import unfrozen
from conf.schemas import store
from models.config import ModelConfig


class WandbMode(enum.Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


class DType(enum.Enum):
    auto = "auto"  # the checkpoint's own dtype (bf16 for real MoE checkpoints); float32 for random weights
    float32 = "float32"
    bfloat16 = "bfloat16"


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.offline
    project: str = "moescope"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class ModelSpec:
    """A model: an architecture (`arch`), a checkpoint folder, or both (then they must agree).

    `checkpoint` is an HF folder (config.json + safetensors); `pkg:<path>` points inside the
    moescope tree (the shipped tiny models). Without a checkpoint the weights are random
    (seeded by the task's `seed`).
    """

    name: str = MISSING
    checkpoint: Optional[str] = None
    arch: Optional[unfrozen(ModelConfig)] = None  # type: ignore[valid-type]
    allow_nonfinite: bool = False  # serve a checkpoint with NaN / Inf weights (refused by default, naming the tensor)


store(ModelSpec, name="base_model", group="model")
