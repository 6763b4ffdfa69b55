"""Architecture of a MoE transformer: one frozen dataclass for every family.

`ModelConfig` is the single source of truth for shapes. The NNX modules, the HF converters, the
cost model of the schedulers and the simulator all read it. Each family module
(`models/<family>.py`) owns the conversion between this dataclass and its HF `config.json`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional


class Family(enum.Enum):
    mixtral = "mixtral"
    qwen3_moe = "qwen3_moe"
    olmoe = "olmoe"
    deepseek_v2 = "deepseek_v2"
    deepseek_v3 = "deepseek_v3"
    phimoe = "phimoe"
    llama4 = "llama4"  # MoE shape only (simulator); no NNX implementation


class ScoringFunc(enum.Enum):
    softmax = "softmax"
    sigmoid = "sigmoid"
    sparsemixer = "sparsemixer"  # PhiMoE


class TopkMethod(enum.Enum):
    greedy = "greedy"
    group_limited_greedy = "group_limited_greedy"  # DeepSeek-V2
    noaux_tc = "noaux_tc"  # DeepSeek-V3: sigmoid + e_score_correction_bias, group top-k


class QKNorm(enum.Enum):
    none = "none"
    per_head = "per_head"  # Qwen3: RMSNorm over head_dim
    full = "full"  # OLMoE: RMSNorm over all heads' q (and k) before the head split


class NormKind(enum.Enum):
    rms = "rms"
    layernorm = "layernorm"  # PhiMoE: LayerNorm with bias


class RopeType(enum.Enum):
    default = "default"
    yarn = "yarn"
    longrope = "longrope"
    llama3 = "llama3"


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling parameters as HF writes them in `rope_scaling` / `rope_parameters`."""

    type: RopeType = RopeType.default
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # longrope
    short_factor: Optional[List[float]] = None
    long_factor: Optional[List[float]] = None
    short_mscale: Optional[float] = None
    long_mscale: Optional[float] = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a decoder-only MoE language model.

    Field names follow HF where the families agree; family-specific HF names are mapped by the
    family's converter (e.g. Mixtral's `num_local_experts` -> `num_experts`).
    """

    family: Family
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int  # dense MLP width (and the expert width where moe_intermediate_size is None)
    num_experts: int
    num_experts_per_tok: int
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    moe_intermediate_size: Optional[int] = None
    n_shared_experts: int = 0  # DeepSeek: one shared MLP of width n_shared_experts * moe_intermediate_size
    shared_expert_intermediate_size: Optional[int] = None  # Llama-4 style shared expert width
    first_k_dense_replace: int = 0  # the first k layers use a dense MLP
    moe_layer_freq: int = 1  # DeepSeek: layer i >= first_k_dense_replace is MoE where i % freq == 0
    decoder_sparse_step: int = 1  # Qwen3: layer i is MoE where (i + 1) % step == 0
    mlp_only_layers: List[int] = field(default_factory=list)  # Qwen3: layers forced dense
    norm_topk_prob: bool = True
    scoring_func: ScoringFunc = ScoringFunc.softmax
    topk_method: TopkMethod = TopkMethod.greedy
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_jitter_noise: float = 0.0  # PhiMoE sparsemixer uses it at inference as its epsilon
    input_jitter_noise: float = 0.0  # training only
    # Multi-head latent attention (DeepSeek). kv_lora_rank None: standard GQA attention.
    kv_lora_rank: Optional[int] = None
    q_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    rope_interleave: bool = False  # DeepSeek: rotary applied to interleaved (even, odd) pairs
    qk_norm: QKNorm = QKNorm.none
    clip_qkv: Optional[float] = None  # OLMoE
    attention_bias: bool = False
    lm_head_bias: bool = False
    norm: NormKind = NormKind.rms
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 4096
    sliding_window: Optional[int] = None
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        self.validate()

    # ---- derived shapes ---------------------------------------------------------------------
    @property
    def attn_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size if self.moe_intermediate_size is not None else self.intermediate_size

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def is_moe_layer(self, layer: int) -> bool:
        """True where layer `layer` (0-based) holds routed experts."""
        if layer in self.mlp_only_layers or layer < self.first_k_dense_replace:
            return False
        return layer % self.moe_layer_freq == 0 and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers that hold routed experts, in order."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    def expert_bytes(self, bytes_per_param: int = 2) -> int:
        """Bytes of one routed expert (bf16 by default, as LayerScope Table 3)."""
        return self.expert_params * bytes_per_param

    def validate(self) -> None:
        """Raise ValueError naming the field for inconsistent shapes."""

        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"model config: {key}: {msg}")

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size", "num_experts", "num_experts_per_tok"):
            need(getattr(self, key) > 0, key, f"must be positive, got {getattr(self, key)}")
        need(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
             f"{self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}")
        need(self.moe_layer_freq >= 1, "moe_layer_freq", "must be >= 1")
        need(self.decoder_sparse_step >= 1, "decoder_sparse_step", "must be >= 1")
        need(self.num_experts % self.n_group == 0, "n_group",
             f"{self.n_group} does not divide num_experts={self.num_experts}")
        need(1 <= self.topk_group <= self.n_group, "topk_group", f"must lie in [1, n_group={self.n_group}]")
        if self.uses_mla:
            for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                need(getattr(self, key) is not None, key, "required with kv_lora_rank (MLA)")
        if self.scoring_func is ScoringFunc.sparsemixer:
            need(self.num_experts_per_tok == 2, "num_experts_per_tok", "sparsemixer routing is top-2")

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
