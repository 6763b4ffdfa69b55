"""GGUF files as moescope checkpoints: `model.checkpoint=<file.gguf>` loads a llama.cpp file as it is.

    ck = open_gguf("qwen3-30b-a3b-Q4_K_M.gguf")   # headers and metadata only: nothing heavy yet
    ck.cfg                                         # ModelConfig from the `<arch>.*` metadata
    ck.reader.quant(piece)                         # one expert matrix: a QuantArray over the mapped blocks
    models.hf.load_hf(ck.folder, opened=ck)        # dense weights dequantized to the run dtype

The file is memory-mapped once (`gguf.GGUFReader`). The reader presents the tensors under the HF names
`models.hf.tensor_sources` uses, so every consumer of an `OpenCheckpoint` (the in-memory loader, the
offload expert store) reads a GGUF file as it reads safetensors:

* routed experts (`blk.N.ffn_{gate,up,down}_exps.weight`, numpy shape [E, out, in]) stay in their ggml
  blocks: `quant(piece)` is a `QuantArray` view of expert `e`'s rows, no copy (bf16 / f16 / f32 experts
  too); `view(piece)` gives the same matrix dequantized, for paths that compute in floats;
* dense weights of any ggml type are dequantized (`gguf.quants.dequantize`) and the converter's
  transforms undone: llama.cpp stores the `llama` architecture's (Mixtral's) q/k rows in ggml's
  adjacent-pair rope order (HF's rotate-half order permuted per head), and DeepSeek-2's `kv_b_proj` as
  `attn_k_b` (transposed per head) + `attn_v_b`.

Families (GGUF `general.architecture` -> moescope family): llama with experts -> mixtral, qwen3moe ->
qwen3_moe, olmoe -> olmoe, deepseek2 -> deepseek_v2 (softmax gating) or deepseek_v3 (sigmoid gating, as
DeepSeek-V3 / Moonlight), phimoe -> phimoe. qwen2moe is refused: moescope has no Qwen2-MoE family (its
shared expert has a sigmoid gate no moescope family models).

What GGUF metadata cannot say and moescope assumes: DeepSeek YaRN `mscale` equals `mscale_all_dim` (the
file keeps only `0.1 * mscale_all_dim`, as llama.cpp assumes); PhiMoE's short and long rope magnitude
scales both equal `rope.scaling.attn_factor`; Qwen3-MoE dense layers (`mlp_only_layers`) are the layers
without a router tensor.

Bad input is a `CheckpointError` of one line before any tensor data is read: a truncated or damaged file
(naming it), an architecture moescope does not model (naming it, listing the supported ones), an expert
tensor in a type no moescope kernel serves (naming the tensor, listing the types), metadata that disagrees
with a tensor's shape (naming the key and the tensor).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import gguf
import ml_dtypes
import numpy as np
from gguf import GGUFValueType

from models.config import Family, ModelConfig, NormKind, QKNorm, RopeScaling, RopeType, ScoringFunc, TopkMethod
from models.hf import CheckpointError, OpenCheckpoint, Piece, tensor_sources
from models.quant.blocks import BY_GGML_ID, QuantArray

# GGUF architecture -> what moescope runs it as (deepseek2 splits by its gating function)
SUPPORTED_ARCHES = ("llama", "qwen3moe", "olmoe", "deepseek2", "phimoe")
_NOT_MODELLED = {"qwen2moe": "moescope has no Qwen2-MoE family (its shared expert's sigmoid gate is not modelled)"}
EXPERT_TYPES = tuple(BY_GGML_ID[i].name for i in sorted(BY_GGML_ID))
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2  # llama.cpp's llama_expert_gating_func_type
_FLOAT_VIEWS = {0: np.dtype(np.float32), 1: np.dtype(np.float16), 30: np.dtype(ml_dtypes.bfloat16)}


def _short(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (what the writer of the file meant)."""
    return float(str(np.float32(value)))


def is_gguf_path(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


# ---- the file ------------------------------------------------------------------------------------


class ArrayField(gguf.ReaderField):
    """A metadata array held whole: its parts are the key's, the item type, the length, then the items as one typed
    view (strings: their bytes as one uint8 view, then each string's start and end in it), where
    `gguf.ReaderField` holds one numpy view per element (and per string length). `contents()` gives the same
    values; `data` = [index of the items' view]."""

    @property
    def count(self) -> int:
        """The array's length."""
        return int(self.parts[self.data[0] - 1][0])

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        at = self.data[0]
        if self.types[-1] != GGUFValueType.STRING:
            return self.parts[at][index_or_slice].tolist()
        raw, starts, ends = self.parts[at:at + 3]
        text = lambda i: str(raw[starts[i]:ends[i]].tobytes(), encoding="utf-8")  # noqa: E731
        if isinstance(index_or_slice, int):
            return text(range(self.count)[index_or_slice])
        return [text(i) for i in range(self.count)[index_or_slice]]


class LeanReader(gguf.GGUFReader):
    """`gguf.GGUFReader` whose metadata arrays are `ArrayField`s. The package's reader makes a numpy view per
    element: a 151,936-token vocabulary and its merges are ~600,000 views, 0.50 GB of anonymous memory held while
    the file is open (measured on a Qwen3-30B-A3B-shaped file: more than the norms, routers and KV cache of the
    model the file holds). Tensors and scalar fields are the package's own."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
        if itype == GGUFValueType.STRING:
            starts, ends = np.empty(n, np.int64), np.empty(n, np.int64)
            buf = memoryview(self.data)
            order = sys.byteorder if self.byte_order == "I" else ("big" if sys.byteorder == "little" else "little")
            at = offs
            for i in range(n):  # each string: a u64 length, then its bytes
                size = int.from_bytes(buf[at:at + 8], order)
                starts[i] = at + 8 - offs
                at += 8 + size
                ends[i] = at - offs
            items = [self.data[offs:at].view(np.uint8), starts, ends]
        elif itype in self.gguf_scalar_to_np:
            items = [self._get(offs, self.gguf_scalar_to_np[itype], n)]
            at = offs + int(items[0].nbytes)
        else:  # arrays of arrays: the package's parts
            return super()._get_field_parts(orig_offs, raw_type)
        return at - orig_offs, [raw_itype, alen, *items], [2], [GGUFValueType.ARRAY, itype]

    def _push_field(self, field: gguf.ReaderField, skip_sum: bool = False) -> int:
        if field.types[:1] == [GGUFValueType.ARRAY] and len(field.types) == 2 and field.types[1] != GGUFValueType.ARRAY:
            field = ArrayField(*field)
        return super()._push_field(field, skip_sum)


class GGUFFile:
    """A GGUF file parsed and checked: metadata values by key, tensors by name (memory-mapped)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"model.checkpoint: {self.path} not found")
        size = self.path.stat().st_size
        try:
            reader = LeanReader(self.path, "r")
        except Exception as exc:  # the reader raises ValueError, IndexError, KeyError ... on damaged bytes
            raise CheckpointError(f"{self.path}: truncated or not a GGUF file ({size} bytes; "
                                  f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        self.reader = reader
        self.tensors = {t.name: t for t in reader.tensors}
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
        if end > size:
            raise CheckpointError(f"{self.path}: truncated ({size} bytes, its tensors need {end})")
        self.file_bytes = size
        self.arch = str(self.get("general.architecture", required=True))

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        """A metadata value (arrays as lists); `{arch}` in `key` is this file's architecture."""
        key = key.replace("{arch}", getattr(self, "arch", "{arch}"))
        field = self.reader.get_field(key)
        if field is None:
            if required:
                raise CheckpointError(f"{self.path}: GGUF metadata lacks required key {key}")
            return default
        value = field.contents()
        if field.types and field.types[-1] == GGUFValueType.FLOAT32:  # 1e-5 stored as f32 reads back as 1e-5
            value = [_short(v) for v in value] if isinstance(value, list) else _short(value)
        return value

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's element shape in numpy order ([out, in] for a matrix, [E, out, in] stacked experts)."""
        t = self.tensors[name]
        return tuple(int(d) for d in reversed(t.shape.tolist()))

    def qtype(self, name: str) -> int:
        return int(self.tensors[name].tensor_type)

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def floats(self, name: str) -> np.ndarray:
        """The tensor as numbers in its numpy shape: a view for f32 / f16 / bf16, dequantized (f32) otherwise."""
        t = self.tensors[name]
        qtype = int(t.tensor_type)
        if qtype in _FLOAT_VIEWS:
            return np.asarray(t.data).view(_FLOAT_VIEWS[qtype]).reshape(self.shape(name))
        return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(self.shape(name))

    def block_rows(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as uint8 [..., rows, row_bytes] (a view of the mapping)."""
        data = np.asarray(self.tensors[name].data)
        shape = self.shape(name)
        return data.view(np.uint8).reshape(*shape[:-1], -1)


# ---- metadata -> ModelConfig ---------------------------------------------------------------------


def _family(f: GGUFFile) -> Family:
    arch = f.arch
    if arch in _NOT_MODELLED:
        raise CheckpointError(f"{f.path}: GGUF architecture {arch!r} is not supported ({_NOT_MODELLED[arch]}); "
                              f"supported: {', '.join(SUPPORTED_ARCHES)}")
    if arch not in SUPPORTED_ARCHES:
        raise CheckpointError(f"{f.path}: GGUF architecture {arch!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ARCHES)}")
    if arch == "llama":
        if not f.get("{arch}.expert_count"):
            raise CheckpointError(f"{f.path}: GGUF architecture 'llama' without experts (llama.expert_count) is a "
                                  "dense model; moescope serves MoE models (llama with experts = Mixtral)")
        return Family.mixtral
    if arch == "deepseek2":
        gating = int(f.get("{arch}.expert_gating_func", _GATING_SOFTMAX))
        return Family.deepseek_v3 if gating == _GATING_SIGMOID else Family.deepseek_v2
    return {"qwen3moe": Family.qwen3_moe, "olmoe": Family.olmoe, "phimoe": Family.phimoe}[arch]


def _per_layer(value: Any) -> int:
    """A length key that may be one number or (newer files) one per layer: its largest."""
    return int(max(value)) if isinstance(value, list) else int(value)


def _layers_with(f: GGUFFile, suffix: str, n_layers: int) -> list[int]:
    return [i for i in range(n_layers) if f"blk.{i}.{suffix}" in f.tensors]


def _rope(f: GGUFFile, family: Family) -> Optional[RopeScaling]:
    kind = f.get("{arch}.rope.scaling.type")
    if family is Family.phimoe and "rope_factors_long.weight" in f.tensors:
        att = f.get("{arch}.rope.scaling.attn_factor")
        return RopeScaling(type=RopeType.longrope, original_max_position_embeddings=f.get(
            "{arch}.rope.scaling.original_context_length"),
            short_factor=[_short(v) for v in f.floats("rope_factors_short.weight")],
            long_factor=[_short(v) for v in f.floats("rope_factors_long.weight")],
            short_mscale=None if att is None else _short(att), long_mscale=None if att is None else _short(att))
    if kind in (None, "none", "linear") and not f.get("{arch}.rope.scaling.factor"):
        return None
    if kind != "yarn":
        raise CheckpointError(f"{f.path}: {f.arch}.rope.scaling.type = {kind!r} is not supported (yarn, longrope)")
    mscale = 10.0 * float(f.get("{arch}.rope.scaling.yarn_log_multiplier", 0.0))
    return RopeScaling(type=RopeType.yarn, factor=float(f.get("{arch}.rope.scaling.factor", 1.0)),
                       original_max_position_embeddings=f.get("{arch}.rope.scaling.original_context_length"),
                       beta_fast=float(f.get("{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                       beta_slow=float(f.get("{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                       mscale=mscale, mscale_all_dim=mscale)


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """The `ModelConfig` the metadata of `f` describes (the family's conventions where the file is silent)."""
    family = _family(f)
    L = int(f.get("{arch}.block_count", required=True))
    H = int(f.get("{arch}.embedding_length", required=True))
    nh = _per_layer(f.get("{arch}.attention.head_count", required=True))
    vocab = f.get("{arch}.vocab_size")
    if vocab is None:
        tokens = f.reader.get_field("tokenizer.ggml.tokens")
        vocab = tokens.count if tokens is not None else f.shape("token_embd.weight")[0]
    eps = f.get("{arch}.attention.layer_norm_rms_epsilon", f.get("{arch}.attention.layer_norm_epsilon", 1e-6))
    moe = [i for i in range(L) if f"blk.{i}.ffn_gate_inp.weight" in f.tensors]
    E = int(f.get("{arch}.expert_count", required=True))
    ff = f.get("{arch}.feed_forward_length")
    expert_ff = f.get("{arch}.expert_feed_forward_length")
    if expert_ff is None and moe:
        expert_ff = f.shape(expert_tensor(f, moe[0], "gate"))[-2]
    common: dict[str, Any] = dict(
        family=family, vocab_size=int(vocab), hidden_size=H, num_hidden_layers=L, num_attention_heads=nh,
        num_key_value_heads=_per_layer(f.get("{arch}.attention.head_count_kv", nh)),
        intermediate_size=_per_layer(ff if ff else expert_ff), num_experts=E,
        num_experts_per_tok=int(f.get("{arch}.expert_used_count", required=True)),
        rms_norm_eps=float(eps), rope_theta=float(f.get("{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope(f, family), max_position_embeddings=int(f.get("{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in f.tensors,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"), eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=f.get("tokenizer.ggml.padding_token_id"),
        sliding_window=f.get("{arch}.attention.sliding_window") or None,
    )
    key_len = f.get("{arch}.attention.key_length")
    if family is Family.mixtral:
        return ModelConfig(**common, norm_topk_prob=True)
    if family is Family.qwen3_moe:
        dense = [i for i in range(L) if i not in moe]
        return ModelConfig(**common, head_dim=None if key_len is None else int(key_len),
                           moe_intermediate_size=int(expert_ff), mlp_only_layers=dense,
                           norm_topk_prob=bool(f.get("{arch}.expert_weights_norm", True)), qk_norm=QKNorm.per_head,
                           attention_bias="blk.0.attn_q.bias" in f.tensors)
    if family is Family.olmoe:
        clip = f.get("{arch}.attention.clamp_kqv")
        return ModelConfig(**common, norm_topk_prob=bool(f.get("{arch}.expert_weights_norm", False)),
                           qk_norm=QKNorm.full, clip_qkv=None if clip is None else float(clip),
                           attention_bias="blk.0.attn_q.bias" in f.tensors)
    if family is Family.phimoe:
        return ModelConfig(**common, scoring_func=ScoringFunc.sparsemixer, norm=NormKind.layernorm,
                           attention_bias="blk.0.attn_q.bias" in f.tensors, lm_head_bias="output.bias" in f.tensors,
                           router_jitter_noise=0.01)  # sparsemixer's epsilon: Phi-3.5-MoE's value, not in GGUF
    return _deepseek_config(f, family, common, moe, int(expert_ff))


def _deepseek_config(f: GGUFFile, family: Family, common: dict[str, Any], moe: list[int], expert_ff: int
                     ) -> ModelConfig:
    nh = common["num_attention_heads"]
    rank = int(f.get("{arch}.attention.kv_lora_rank", required=True))
    rope_d = int(f.get("{arch}.rope.dimension_count", required=True))
    mla_k = f.get("{arch}.attention.key_length_mla")
    if mla_k is not None:  # newer files: MLA as one latent kv head; the per-head sizes sit in the *_mla keys
        nope, vd = int(mla_k) - rope_d, int(f.get("{arch}.attention.value_length_mla", required=True))
    else:
        nope = int(f.get("{arch}.attention.key_length", required=True)) - rope_d
        vd = int(f.get("{arch}.attention.value_length", required=True))
    q_lora = f.get("{arch}.attention.q_lora_rank")
    groups = int(f.get("{arch}.expert_group_count", 1) or 1)
    common = {**common, "num_key_value_heads": nh}  # MLA: the file's head_count_kv (1 latent head) is not GQA
    shared = dict(moe_intermediate_size=expert_ff,
                  n_shared_experts=int(f.get("{arch}.expert_shared_count", 0) or 0),
                  first_k_dense_replace=int(f.get("{arch}.leading_dense_block_count", 0) or 0),
                  n_group=groups, topk_group=int(f.get("{arch}.expert_group_used_count", groups) or groups),
                  routed_scaling_factor=float(f.get("{arch}.expert_weights_scale", 1.0) or 1.0),
                  kv_lora_rank=rank, q_lora_rank=None if not q_lora else int(q_lora), qk_nope_head_dim=nope,
                  qk_rope_head_dim=rope_d, v_head_dim=vd, rope_interleave=True,
                  attention_bias="blk.0.attn_q_a.bias" in f.tensors)
    if family is Family.deepseek_v2:
        method = TopkMethod.group_limited_greedy if groups > 1 else TopkMethod.greedy
        return ModelConfig(**common, **shared, scoring_func=ScoringFunc.softmax, topk_method=method,
                           norm_topk_prob=False)
    return ModelConfig(**common, **shared, scoring_func=ScoringFunc.sigmoid, topk_method=TopkMethod.noaux_tc,
                       norm_topk_prob=bool(f.get("{arch}.expert_weights_norm", False)))


# ---- HF names -> GGUF tensors ----------------------------------------------------------------------


_PER_EXPERT_RE = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$")


def is_expert_tensor(name: str) -> bool:
    """A routed expert tensor: stacked `blk.N.ffn_gate_exps.weight`, or one expert's `blk.N.ffn_gate.E.weight` (the
    layout older llama.cpp converters wrote for Mixtral)."""
    return "_exps." in name or bool(_PER_EXPERT_RE.match(name))


def expert_tensor(f: GGUFFile, layer: int, kind: str, expert: int = 0) -> str:
    """The tensor holding expert `expert`'s `kind` (gate, up, down) matrix of `layer`: the stacked tensor, or in an
    older Mixtral file the expert's own (each then a view of its own blocks, as stacked rows are)."""
    stacked = f"blk.{layer}.ffn_{kind}_exps.weight"
    if stacked in f.tensors or f"blk.{layer}.ffn_{kind}.0.weight" not in f.tensors:
        return stacked
    return f"blk.{layer}.ffn_{kind}.{expert}.weight"


@dataclass(frozen=True)
class Source:
    """Where one HF-named tensor lies in the GGUF file: tensor(s), expert index, and the transform undone."""

    tensors: tuple[str, ...]
    expert: Optional[int] = None
    make: Optional[Callable[[list[np.ndarray]], np.ndarray]] = None  # the HF tensor from the GGUF floats
    stacked: bool = True  # an expert's matrix is row `expert` of a stacked [E, out, in] tensor, else a tensor of its own


_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "model.norm.bias": "output_norm.bias", "lm_head.weight": "output.weight", "lm_head.bias": "output.bias"}
_LAYER = {  # HF name after `model.layers.N.` -> GGUF name after `blk.N.`
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp", "mlp.router": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
_EXPERT_KIND = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_CORRECTION_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$")


def rope_halves_from_pairs(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection (or bias) put back per head from ggml's adjacent-pair rope order
    ((x0, x1), (x2, x3), ...) into HF's rotate-half order ([x0, x2, ...], [x1, x3, ...]): the inverse of
    the row permutation llama.cpp's converter applies to the `llama` architecture."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _kv_b_from_split(cfg: ModelConfig) -> Callable[[list[np.ndarray]], np.ndarray]:
    """kv_b_proj [nh * (nope + v), rank] from attn_k_b [nh, rank, nope] and attn_v_b [nh, v, rank]."""
    nh, rank = cfg.num_attention_heads, cfg.kv_lora_rank

    def make(parts: list[np.ndarray]) -> np.ndarray:
        k_b, v_b = parts
        k = np.asarray(k_b).reshape(nh, rank, cfg.qk_nope_head_dim).transpose(0, 2, 1)
        v = np.asarray(v_b).reshape(nh, cfg.v_head_dim, rank)
        return np.concatenate([k, v], axis=1).reshape(-1, rank)

    return make


def gguf_source(cfg: ModelConfig, name: str, f: GGUFFile) -> Optional[Source]:
    """The GGUF tensor(s) an HF-named model tensor comes from, or None for a name moescope does not know."""
    if name in _GLOBAL:
        return Source((_GLOBAL[name],))
    m = _EXPERT_RE.match(name)
    if m:
        layer, expert, hf = m.groups()
        tensor = expert_tensor(f, int(layer), _EXPERT_KIND[hf], int(expert))
        return Source((tensor,), expert=int(expert), stacked=tensor.endswith("_exps.weight"))
    m = _CORRECTION_RE.match(name)
    if m:
        return Source((f"blk.{m.group(1)}.exp_probs_b.bias",))
    m = _LAYER_RE.match(name)
    if not m or m.group(2) not in _LAYER:
        return None
    layer, hf, kind = m.groups()
    gname = f"blk.{layer}.{_LAYER[hf]}.{kind}"
    if hf == "self_attn.kv_b_proj" and gname not in f.tensors:
        return Source((f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"), make=_kv_b_from_split(cfg))
    if cfg.family is Family.mixtral and hf in ("self_attn.q_proj", "self_attn.k_proj"):
        heads = cfg.num_attention_heads if hf == "self_attn.q_proj" else cfg.num_key_value_heads
        return Source((gname,), make=lambda parts, heads=heads: rope_halves_from_pairs(parts[0], heads))
    return Source((gname,))


# tensors a GGUF file may carry that are not model parameters (rope tables are read into the config)
_IGNORED = re.compile(r"^(rope_freqs|rope_factors_long|rope_factors_short)\.weight$")


class GGUFTensors:
    """A GGUF file's tensors under moescope's HF names: the `CheckpointReader` interface (`keys`, `shape`,
    `dtype`, `view`) plus `quant` for routed experts kept in their blocks."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, names: list[str]):
        self.file = f
        self.folder = f.path  # where errors point (a file, not a folder)
        self.file_bytes = f.file_bytes
        self.cfg = cfg
        self._sources: dict[str, Source] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name in names:
            src = gguf_source(cfg, name, f)
            if src is not None and all(t in f.tensors for t in src.tensors):
                self._sources[name] = src

    def keys(self) -> list[str]:
        return list(self._sources)

    def source(self, name: str) -> Source:
        return self._sources[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF shape of `name` as the file holds it (before any check against the config)."""
        if name not in self._shapes:
            src = self._sources[name]
            shapes = [self.file.shape(t) for t in src.tensors]
            if src.expert is not None:
                shape = shapes[0][1:] if src.stacked else shapes[0]
            elif len(shapes) == 2:  # split kv_b: [nh, rank, nope] + [nh, v, rank]
                (nh, rank, nope), (_, v, _) = shapes
                shape = (nh * (nope + v), rank)
            else:
                shape = shapes[0]
            self._shapes[name] = tuple(int(d) for d in shape)
        return self._shapes[name]

    def dtype(self, name: str) -> np.dtype:
        """The dtype `view` returns: the stored float type, float32 for quantized tensors (dequantized)."""
        src = self._sources[name]
        qtype = self.file.qtype(src.tensors[0])
        if src.make is None and qtype in _FLOAT_VIEWS:
            return _FLOAT_VIEWS[qtype]
        return np.dtype(np.float32)

    def view(self, piece: Piece) -> np.ndarray:
        """The tensor as numbers in HF's layout: a view of the mapping where the file stores floats as HF does,
        else a fresh float32 array (dequantized, transform undone)."""
        src = self._sources[piece.name]
        if src.expert is not None:
            floats = self.file.floats(src.tensors[0])
            return floats[src.expert] if src.stacked else floats
        parts = [self.file.floats(t) for t in src.tensors]
        out = parts[0] if src.make is None else src.make(parts)
        if out.dtype != self.dtype(piece.name):
            out = out.astype(self.dtype(piece.name))
        return out if piece.index is None else out[piece.index]

    @property
    def run_dtype(self) -> np.dtype:
        """The dtype `dtype=auto` runs this file in: float32 where its matrices are stored in float32 (the file holds
        an f32 model exactly), else bfloat16 (bf16 / f16 / quantized files: what llama.cpp computes such a file's
        activations in is f32, but the dense weights gain nothing from f32 copies of bf16-or-coarser values)."""
        t = self.file.tensors.get("token_embd.weight")
        return np.dtype(np.float32) if t is not None and int(t.tensor_type) == 0 else np.dtype(ml_dtypes.bfloat16)

    def quant(self, piece: Piece) -> QuantArray:
        """A routed expert's matrix in its stored ggml blocks: a view of the mapped file, no copy."""
        src = self._sources[piece.name]
        if src.expert is None:
            raise KeyError(f"{piece.name} is not a routed expert's matrix")
        tname = src.tensors[0]
        qtype = BY_GGML_ID[self.file.qtype(tname)].name
        rows, cols = self.file.shape(tname)[-2:]
        blocks = self.file.block_rows(tname)
        return QuantArray(blocks[src.expert] if src.stacked else blocks, qtype, (rows, cols))

    def expert_type(self, name: str) -> str:
        """The block type (a key of models.quant.blocks.BLOCK_TYPES) an expert matrix is stored in."""
        return BY_GGML_ID[self.file.qtype(self._sources[name].tensors[0])].name


# ---- checks ------------------------------------------------------------------------------------------


def _check_expert_types(f: GGUFFile) -> None:
    for name in f.tensors:
        if is_expert_tensor(name) and f.qtype(name) not in BY_GGML_ID:
            raise CheckpointError(f"{f.path}: expert tensor {name} is stored as {f.type_name(name)}; moescope serves "
                                  f"experts stored as {', '.join(t.upper() for t in EXPERT_TYPES)}")


def _check_metadata(f: GGUFFile, cfg: ModelConfig) -> None:
    """Metadata that sets a dimension, checked against the first tensor that has it (naming both)."""
    arch = f.arch

    def agree(key: str, value: int, tensor: str, axis: int) -> None:
        if tensor not in f.tensors:
            return
        shape = f.shape(tensor)
        if shape[axis] != value:
            raise CheckpointError(f"{f.path}: metadata {key} = {value} disagrees with tensor {tensor} of shape "
                                  f"{list(shape)} (axis {axis} is {shape[axis]})")

    agree(f"{arch}.embedding_length", cfg.hidden_size, "token_embd.weight", 1)
    agree(f"{arch}.vocab_size" if f.get("{arch}.vocab_size") is not None else "tokenizer.ggml.tokens (its length)",
          cfg.vocab_size, "token_embd.weight", 0)
    last = f"blk.{cfg.num_hidden_layers - 1}.attn_norm.weight"
    if last not in f.tensors or f"blk.{cfg.num_hidden_layers}.attn_norm.weight" in f.tensors:
        present = max((int(m.group(1)) for n in f.tensors if (m := re.match(r"blk\.(\d+)\.", n))), default=-1) + 1
        raise CheckpointError(f"{f.path}: metadata {arch}.block_count = {cfg.num_hidden_layers} disagrees with the "
                              f"tensors (blk.0 ... blk.{present - 1}.attn_norm.weight: {present} blocks)")
    for i in cfg.moe_layers:
        exps = expert_tensor(f, i, "gate")
        stacked = exps.endswith("_exps.weight")  # else one expert's own [F, H] (an older Mixtral file)
        if stacked:
            agree(f"{arch}.expert_count", cfg.num_experts, exps, 0)
        agree(f"{arch}.expert_count", cfg.num_experts, f"blk.{i}.ffn_gate_inp.weight", 0)
        agree(f"{arch}.expert_feed_forward_length" if f.get("{arch}.expert_feed_forward_length") is not None
              else f"{arch}.feed_forward_length", cfg.expert_intermediate_size, exps, 1 if stacked else 0)
    if not cfg.uses_mla:
        d = cfg.attn_head_dim
        agree(f"{arch}.attention.head_count", cfg.num_attention_heads * d, "blk.0.attn_q.weight", 0)
        agree(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads * d, "blk.0.attn_k.weight", 0)
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    if dense:
        agree(f"{arch}.feed_forward_length", cfg.intermediate_size, f"blk.{dense[0]}.ffn_gate.weight", 0)


def _check_tensors(reader: GGUFTensors, f: GGUFFile, sources: list) -> None:
    """Every model parameter present with the shape the config implies; every file tensor used."""
    used: set[str] = set()
    problems: list[str] = []
    for src in sources:
        for piece in src.pieces:
            if piece.name not in reader._sources:
                guess = gguf_source(reader.cfg, piece.name, f)
                where = " + ".join(guess.tensors) if guess else piece.name
                problems.append(f"missing tensor {where} (for {piece.name}, shape {list(piece.shape)})")
                continue
            used.update(reader.source(piece.name).tensors)
            got = reader.shape(piece.name)
            if got != piece.shape:
                problems.append(f"tensor {' + '.join(reader.source(piece.name).tensors)} holds {piece.name} as "
                                f"{list(got)}, the metadata implies {list(piece.shape)}")
    extra = [n for n in f.tensors if n not in used and not _IGNORED.match(n)
             and not _beyond_last_layer(n, reader.cfg.num_hidden_layers)]
    problems += [f"unexpected tensor {n} ({f.type_name(n)} {list(f.shape(n))})" for n in extra[:8]]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"{f.path}: GGUF tensors do not match its metadata: {'; '.join(problems[:3])}{more}")


def _beyond_last_layer(name: str, n_layers: int) -> bool:
    m = re.match(r"blk\.(\d+)\.", name)  # DeepSeek-V3's multi-token-prediction blocks; inference ignores them
    return bool(m) and int(m.group(1)) >= n_layers


def open_gguf(path: str | Path) -> OpenCheckpoint:
    """Parse a GGUF file and check its architecture, metadata, tensor types and shapes (no tensor data read)."""
    f = GGUFFile(path)
    cfg = _config_or_error(f)
    _check_expert_types(f)
    _check_metadata(f, cfg)
    sources = tensor_sources(cfg, fused=False)
    reader = GGUFTensors(f, cfg, [p.name for s in sources for p in s.pieces])
    _check_tensors(reader, f, sources)
    return OpenCheckpoint(f.path, cfg, reader, sources, fused=False)  # type: ignore[arg-type]


def _config_or_error(f: GGUFFile) -> ModelConfig:
    try:
        return config_from_gguf(f)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{f.path}: GGUF metadata does not describe a {f.arch} model moescope can build ({exc})"
                              ) from None


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` of a GGUF file (its architecture and metadata checked; tensors not read)."""
    return open_gguf(path).cfg


# ---- experts in their blocks --------------------------------------------------------------------------


def block_experts(ck: OpenCheckpoint) -> dict[int, tuple[list[tuple[QuantArray, QuantArray]], list[QuantArray]]]:
    """Decoder layer -> ((gate, up) pairs, down) `QuantArray`s of every routed expert, in the blocks the file stores
    them in: views of the mapped file, no copy (the layout `models.quant.experts.install` takes). A layer's gate and
    up must share a block type (llama.cpp's presets give them one); down may differ (Q4_K_M's Q6_K layers)."""
    reader = ck.reader
    if not isinstance(reader, GGUFTensors):
        raise TypeError(f"{ck.folder}: not a GGUF checkpoint")
    _warn_unaliasable(ck)
    out: dict[int, tuple[list[tuple[QuantArray, QuantArray]], list[QuantArray]]] = {}
    for src in ck.sources:
        if src.expert is None:
            continue
        layer = src.expert[0]
        lists = out.setdefault(layer, ([], []))
        if src.path[-2] == "gate_up":
            gate, up = (reader.quant(p) for p in src.pieces)
            if gate.qtype != up.qtype:
                raise CheckpointError(f"{ck.folder}: blk.{layer}.ffn_gate_exps ({gate.qtype}) and ffn_up_exps "
                                      f"({up.qtype}) differ in type; moescope serves a layer's gate and up in one type")
            lists[0].append((gate, up))
        else:
            lists[1].append(reader.quant(src.pieces[0]))
    return out


def block_expert_stacks(ck: OpenCheckpoint) -> Optional[dict[int, tuple[Any, Any, Any]]]:
    """Decoder layer -> (gate, up, down) `models.quant.experts.QuantStack`s: each MoE layer's three stacked expert
    tensors as they are (uint8 [E, rows, row_bytes] views of the mapped file, no copy; the layout
    `models.quant.experts.install_stacks` takes). None for a file without stacked expert tensors (an older Mixtral
    file's per-expert tensors: `block_experts`) or with experts in a float type."""
    from models.quant.experts import QuantStack

    reader = ck.reader
    if not isinstance(reader, GGUFTensors):
        raise TypeError(f"{ck.folder}: not a GGUF checkpoint")
    f = reader.file
    out: dict[int, tuple[Any, Any, Any]] = {}
    for layer in ck.cfg.moe_layers:
        names = [f"blk.{layer}.ffn_{kind}_exps.weight" for kind in ("gate", "up", "down")]
        if any(n not in f.tensors or BY_GGML_ID.get(f.qtype(n)) is None for n in names):
            return None
        stacks = tuple(QuantStack(f.block_rows(n), BY_GGML_ID[f.qtype(n)].name, f.shape(n)[1:]) for n in names)
        if stacks[0].qtype != stacks[1].qtype:
            raise CheckpointError(f"{ck.folder}: blk.{layer}.ffn_gate_exps ({stacks[0].qtype}) and ffn_up_exps "
                                  f"({stacks[1].qtype}) differ in type; moescope serves a layer's gate and up in one type")
        out[layer] = stacks
    _warn_unaliasable(ck)
    return out


XLA_ALIAS_ALIGNMENT = 64  # XLA:CPU aliases a host buffer (device_put may_alias) only at a 64-byte-aligned address


def unaliasable_expert_bytes(f: GGUFFile) -> int:
    """Bytes of routed-expert tensors whose data does not start 64-byte aligned in the mapping: on the CPU backend
    `install` cannot alias them and copies them into memory. GGUF aligns tensor data to `general.alignment` (32
    by default), so in a file whose data section starts 32 bytes off every such tensor is copied."""
    return sum(int(t.n_bytes) for name, t in f.tensors.items()
               if is_expert_tensor(name) and (np.asarray(t.data).ctypes.data % XLA_ALIAS_ALIGNMENT))


def _warn_unaliasable(ck: OpenCheckpoint) -> None:
    import logging

    f = ck.reader.file
    copied = unaliasable_expert_bytes(f)
    if copied:
        logging.getLogger(__name__).warning(
            "%s: %.2f GB of expert tensors start off a 64-byte boundary (general.alignment = %s) and will be copied "
            "into memory instead of mapped; rewrite the file with 64-byte alignment to map them: python -m "
            "models.gguf_realign %s <out.gguf>", f.path, copied / 1e9, f.get("general.alignment", 32), f.path)


def has_block_experts(ck: OpenCheckpoint) -> bool:
    """True for a GGUF checkpoint whose routed experts are in a quantized block type (served by the block kernels)."""
    from models.quant.blocks import QUANTIZED

    reader = ck.reader
    if not isinstance(reader, GGUFTensors):
        return False
    return any(reader.expert_type(p.name) in QUANTIZED for s in ck.sources if s.expert is not None for p in s.pieces)


# ---- dense projections in their blocks (model.dense_format=blocks) ----------------------------------------------


def block_dense(ck: OpenCheckpoint) -> dict[tuple, list[QuantArray]]:
    """Module path (`models.quant.dense.dense_path`) -> row parts (`QuantArray`s, views of the mapped file) of each
    dense projection a GGUF file stores in block types the native kernels read: the attention projections, the dense
    SwiGLU MLPs (a dense layer's, DeepSeek's shared experts: both of their matrices or neither) and the LM head. A
    projection kind (e.g. every layer's qkv) is kept in blocks only when every layer's tensors for it are (one module
    structure for all layers); Mixtral's q/k rows are put back into HF's rope order (a row permutation
    of the blocks: a copy of those two matrices). Empty for other checkpoints."""
    from models.native import QTYPE_IDS
    from models.quant.dense import dense_kind, dense_path

    reader = ck.reader
    if not isinstance(reader, GGUFTensors):
        return {}
    found: dict[tuple, list[QuantArray]] = {}
    refused: set = set()
    for src in ck.sources:
        path = dense_path(src.path)
        if path is None or src.expert is not None:
            continue
        kind = dense_kind(path)
        parts = []
        for piece in src.pieces:
            gsrc = reader.source(piece.name)
            qtype = BY_GGML_ID.get(reader.file.qtype(gsrc.tensors[0]))
            if len(gsrc.tensors) != 1 or qtype is None or qtype.name not in QTYPE_IDS or piece.index is not None:
                refused.add(kind)
                break
            rows = reader.file.block_rows(gsrc.tensors[0])
            if gsrc.make is not None:  # a single-tensor transform is the rope row order: rows moved, blocks kept
                rows = np.ascontiguousarray(gsrc.make([rows]))
            parts.append(QuantArray(rows, qtype.name, reader.shape(piece.name)))
        else:
            found[path] = parts
    return {p: q for p, q in found.items() if dense_kind(p) not in refused}
