"""Schema of `python -m models.train`: pre-training a tiny MoE language model on offline text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from omegaconf import MISSING

from core.config import store
from core.telemetry import WandbConfig
from models.loading import DType, ModelSpec
from models.corpus import CorpusSource


@dataclass
class CorpusSpec:
    sources: List[CorpusSource] = field(
        default_factory=lambda: [CorpusSource.sharegpt, CorpusSource.stdlib_docs, CorpusSource.stdlib_source])
    validation_fraction: float = 0.05
    max_chars: Optional[int] = None  # per source (whole documents); None: everything
    repeat: Dict[str, int] = field(default_factory=lambda: {"sharegpt": 4})  # source -> copies in the train stream


@dataclass
class OptimConfig:
    lr: float = 2e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    clip_norm: float = 1.0


@dataclass
class TrainConfig:
    model: ModelSpec = MISSING
    corpus: CorpusSpec = field(default_factory=CorpusSpec)
    tokenizer: Optional[str] = None  # an HF tokenizer folder; None: train a byte-level BPE of the model's vocab size
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    optim: OptimConfig = field(default_factory=OptimConfig)
    aux_loss_coef: float = 0.001  # small on purpose: real models keep hot experts
    capacity_factor: float = 2.0
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    resume: Optional[str] = None  # a previous run folder (or its checkpoints/) to continue from
    max_minutes: Optional[float] = None  # stop early (checkpoint + export) after this wall time
    export_dir: Optional[str] = None  # default: <run dir>/export
    export_dtype: DType = DType.bfloat16
    seed: int = 0
    wandb: WandbConfig = field(default_factory=WandbConfig)


store(TrainConfig, name="base_train")
