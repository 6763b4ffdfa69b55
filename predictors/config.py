"""The `predictor` config group: one expert predictor (conf/predictor/<kind>.yaml), and its conversions
from a Hydra node, a plain dict or a saved checkpoint.

Every consumer (the simulator, the offload executor, `python -m predictors.train`) reads a
predictor through this one schema and `predictors.load_predictor`. Kind-specific settings live in
the section named after the kind; the others keep their defaults and are ignored.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from omegaconf import MISSING, DictConfig, OmegaConf

from core.config import store


class PredictorKind(enum.Enum):
    stats = "stats"  # per-layer hot-expert frequencies of the training data
    transition = "transition"  # layer l's experts -> layer l+d's expert frequencies (a transition table)
    gate = "gate"  # layer l+d's router applied to layer l's gate input (no training)
    token = "token"  # a light net from the token embedding (+ layer l's routing) to layer l+d's experts
    llapor = "llapor"  # LayerScope §4.2: per-layer, layer-group-aware learned predictor
    moeless = "moeless"  # MoEless §4.1: copies of layer l+d's gate, fine-tuned where below the threshold
    oracle = "oracle"  # the true routing of the replayed trace (optionally degraded to a hit rate)


class LayerGroup(enum.Enum):
    input = "input"
    middle = "middle"
    output = "output"


class GroupMode(enum.Enum):
    data = "data"  # from gate-input cosine similarity and routing correlation of the training trace (§3.1)
    manual = "manual"  # `input` / `output` lists below; every other target layer is middle


class LossKind(enum.Enum):
    hybrid = "hybrid"  # L_expert + lambda * L_focal (LayerScope §4.2.3)
    bce = "bce"  # mean binary cross-entropy over experts


class Schedule(enum.Enum):
    constant = "constant"
    cosine = "cosine"  # linear warmup for `warmup_epochs`, then cosine decay to min_lr_ratio * lr


class LoadMetric(enum.Enum):
    load = "load"  # per-step overlap of predicted and true load shares (MoEless Fig. 15)
    hit = "hit"  # per-token top-k hit rate


@dataclass
class OptimSpec:
    """AdamW (optax) and its learning-rate schedule, counted in epochs."""

    lr: float = 2e-3
    weight_decay: float = 1e-4
    schedule: Schedule = Schedule.cosine
    warmup_epochs: int = 0
    min_lr_ratio: float = 0.05
    clip_norm: float = 1.0


@dataclass
class TrainSpec:
    epochs: int = 30
    batch_size: int = 256


@dataclass
class NetSpec:
    """One layer group's LLaPor net: PCA of the gate input fused with the source layer's routing."""

    pca_ratio: float = 0.0625  # PCA dims = ceil(pca_ratio * hidden_size) (paper: 4096 -> 256)
    pca_min_dim: int = 8
    width: int = 128
    blocks: int = 1  # Linear -> GELU -> Dropout blocks before the output layer
    residual_blocks: int = 0  # gated residual blocks (middle groups)
    residual_depth: int = 2  # Linear -> GELU -> Dropout layers inside one residual block
    dropout: float = 0.1
    loss: LossKind = LossKind.hybrid
    focal_lambda: float = 1.0  # lambda of L = L_expert + lambda * L_focal
    focal_gamma: float = 2.0
    min_frequency: float = 1e-3  # floor of the expert frequency f_i in 1 / f_i
    optim: OptimSpec = field(default_factory=OptimSpec)


@dataclass
class GroupsSpec:
    mode: GroupMode = GroupMode.data
    input: List[int] = field(default_factory=list)  # manual: target MoE layers of the input group
    output: List[int] = field(default_factory=list)  # manual: target MoE layers of the output group


@dataclass
class OnlineSpec:
    """Online fine-tuning (LayerScope §4.2.3): error over the last `window` tokens above `threshold`
    triggers `steps` AdamW steps on the last `buffer` tokens' runtime data."""

    enabled: bool = True
    groups: List[LayerGroup] = field(default_factory=lambda: [LayerGroup.input])
    window: int = 64
    threshold: float = 0.10
    buffer: int = 128
    steps: int = 4
    lr: float = 3e-4
    weight_decay: float = 0.0


@dataclass
class LLaPorSpec:
    groups: GroupsSpec = field(default_factory=GroupsSpec)
    input: NetSpec = field(default_factory=NetSpec)
    middle: NetSpec = field(default_factory=NetSpec)
    output: Optional[NetSpec] = None  # None: the output group is trained like the input group
    online: OnlineSpec = field(default_factory=OnlineSpec)

    def net(self, group: LayerGroup) -> NetSpec:
        """The net spec of a layer group."""
        if group is LayerGroup.output and self.output is None:
            return self.input
        return getattr(self, group.value)


@dataclass
class TokenSpec:
    embed_dim: int = 32  # PCA of the model's token embedding
    width: int = 128
    dropout: float = 0.1
    use_routing: bool = True  # fuse the source layer's routing (expert-expert correlation)
    optim: OptimSpec = field(default_factory=OptimSpec)


@dataclass
class MoElessSpec:
    threshold: float = 0.8  # h: layers whose profiled accuracy is below it are fine-tuned
    metric: LoadMetric = LoadMetric.load
    max_epochs: int = 20  # fine-tuning stops at the first epoch that reaches h, or here
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0


@dataclass
class StatsSpec:
    online: bool = False  # keep counting the observed routing at run time


@dataclass
class OracleSpec:
    hit_rate: float = 1.0  # each true (token, expert) pair kept with this probability (at distance 1)
    distance_decay: float = 1.0  # hit rate multiplier per layer of distance beyond the first (or beyond `hit_rates`)
    hit_rates: List[float] = field(default_factory=list)  # per distance 1, 2, ...: overrides hit_rate x decay there
    source: str = ""  # where `hit_rates` come from (a measurement and its command); "" = set by hand

    def __post_init__(self) -> None:
        # `hit_rates` wins over `hit_rate`: a command-line hit_rate that disagrees would be silently ignored
        if self.hit_rates and abs(float(self.hit_rates[0]) - float(self.hit_rate)) > 1e-12:
            raise ValueError(f"predictor.oracle.hit_rate={self.hit_rate} disagrees with predictor.oracle.hit_rates[0]="
                             f"{self.hit_rates[0]} (hit_rates={list(self.hit_rates)}); set predictor.oracle.hit_rates=[] "
                             "to use hit_rate x distance_decay, or set hit_rates itself")

    def provenance(self) -> str:
        """Where the hit rates come from: `source` for a per-distance list that names one, else set by hand."""
        return self.source if self.hit_rates and self.source else "set by hand (assumed, not measured)"

    def at(self, distance: int) -> float:
        """The hit rate at `distance` (>= 1): `hit_rates[d - 1]` where given, else the last given (or `hit_rate`)
        times `distance_decay` per further layer."""
        if distance < 1:
            raise ValueError(f"predictor.oracle: distance must be >= 1, got {distance}")
        if distance <= len(self.hit_rates):
            return float(self.hit_rates[distance - 1])
        base, d0 = (float(self.hit_rates[-1]), len(self.hit_rates)) if self.hit_rates else (self.hit_rate, 1)
        return base * self.distance_decay ** (distance - d0)


@dataclass
class PredictorConfig:
    name: str = MISSING
    kind: PredictorKind = MISSING
    distance: int = 1  # predicts MoE layer l + distance from layer l
    checkpoint: Optional[str] = None  # a trained predictor folder (pkg: allowed), written by predictors.train
    seed: int = 0
    train: TrainSpec = field(default_factory=TrainSpec)
    stats: StatsSpec = field(default_factory=StatsSpec)
    token: TokenSpec = field(default_factory=TokenSpec)
    llapor: LLaPorSpec = field(default_factory=LLaPorSpec)
    moeless: MoElessSpec = field(default_factory=MoElessSpec)
    oracle: OracleSpec = field(default_factory=OracleSpec)


store(PredictorConfig, name="base_predictor", group="predictor")


ROUTING_ONLY = (PredictorKind.stats, PredictorKind.transition)  # fitted from routing alone (no gate inputs)
NEEDS_HIDDEN = (PredictorKind.gate, PredictorKind.llapor, PredictorKind.moeless)  # read layer l's gate input


def oracle_config(hit_rate: float = 1.0, distance_decay: float = 1.0, seed: int = 0,
                  hit_rates: Sequence[float] = (), source: str = "") -> PredictorConfig:
    """The oracle predictor's config (an upper bound: the replayed routing itself, degraded to `hit_rate`, or to
    `hit_rates` per distance)."""
    return PredictorConfig(name="oracle", kind=PredictorKind.oracle, seed=seed,
                           oracle=OracleSpec(hit_rate=hit_rate, distance_decay=distance_decay,
                                             hit_rates=[float(h) for h in hit_rates], source=source))


def predictor_config(node: Any) -> PredictorConfig:
    """A validated `PredictorConfig` from a `predictor` node, a dict or a `PredictorConfig` (errors name the key)."""
    if isinstance(node, PredictorConfig):
        return node
    if not isinstance(node, (DictConfig, dict)):
        raise TypeError(f"predictor config: expected a DictConfig, dict or PredictorConfig, got {type(node).__name__}")
    merged = OmegaConf.merge(OmegaConf.structured(PredictorConfig), node)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def config_dict(cfg: PredictorConfig) -> dict[str, Any]:
    """JSON-ready dict of a predictor config (enums by name)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)  # type: ignore[return-value]
