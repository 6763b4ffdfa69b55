"""Convert an HF MoE checkpoint (safetensors, single or sharded) into a GGUF file that llama.cpp runs.

    python -m engine.bench.peers.to_gguf CKPT_DIR OUT.gguf [--mla split|joint] [--dense bf16|f32]
                                         [--experts f32|bf16|q8_0|q4_0]

Standalone on purpose: it needs only numpy and the `gguf` package (no torch, no jax, no moescope
imports), so it runs in the venv that holds llama-cpp-python. Safetensors files are read through
their JSON header and a numpy memmap, bf16 kept as raw uint16 bits; tensors are streamed into the
GGUF one at a time (memory stays about one stacked expert tensor). It writes the names, metadata and
transforms llama.cpp's own converter writes, so `models.gguf` (which loads llama.cpp's files) is tested on it.

Families (HF `model_type` -> llama.cpp architecture):
  mixtral   -> llama (with experts); q/k rows permuted from HF's rotate-half order to GGML's pairwise rope
  qwen3_moe -> qwen3moe (NeoX rope: no permutation; per-head q/k norms)
  olmoe     -> olmoe (q/k norms over all heads; clip_qkv as attention.clamp_kqv)
  phimoe    -> phimoe (LayerNorms and attention / LM-head biases; long-rope factors as rope_factors_{long,short})
  deepseek_v2 / deepseek_v3 -> deepseek2 (MLA; `--mla split`, the default, writes kv_b_proj as the per-head
               attn_k_b / attn_v_b pair with one latent kv head, which llama.cpp runs as absorbed MLA (its kv cache
               holds rank + rope dims per token); `--mla joint` writes one attn_kv_b, run as plain multi-head
               attention. V3: sigmoid gating, exp_probs_b (e_score_correction_bias), group counts. Without
               q-LoRA, llama.cpp (the build in llama-cpp-python 0.3.16) only accepts the model at 27 layers: it
               tells DeepSeek-V2-Lite from V2 by the layer count.)
Both the per-expert layout (`experts.E.w1` / `experts.E.gate_proj`) and the fused transformers-v5 layout
(`experts.gate_up_proj` [E, 2F, H], `experts.down_proj` [E, H, F]) are read. Norm weights, biases and the
router are written F32, the matrices BF16 (or F32 with `--dense f32`), the routed experts in `--experts`'s type
(Q8_0 / Q4_0 blocks made by the `gguf` package's quantizer; Q4_K / Q6_K by moescope's port of llama.cpp's
reference quantizer, models.quant.formats, the one import outside numpy and gguf, made only for those types). The vocabulary is the checkpoint's tokenizer.json
where it is a byte-level BPE (written as llama.cpp's `gpt2` tokenizer), else placeholder tokens (ids only):
the peers feed token ids, never text.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

import gguf

BF16 = gguf.GGMLQuantizationType.BF16
F32 = gguf.GGMLQuantizationType.F32
FILE_TYPE_BF16 = 32  # llama_ftype LLAMA_FTYPE_MOSTLY_BF16

# general.alignment of the files written here: `models.gguf.XLA_ALIAS_ALIGNMENT` (kept here because this converter
# imports nothing of the project). With GGUF's default 32, a file whose data section starts 32 bytes off has every
# expert copied instead of mapped.
ALIGNMENT = 64

ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
        "olmoe": "olmoe", "phimoe": "phimoe"}


class Checkpoint:
    """Tensors of a safetensors checkpoint folder as uint16 (bf16 bits) / float32 numpy views."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.config = json.loads((self.folder / "config.json").read_text())
        index = self.folder / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
            else ["model.safetensors"]
        self.meta: dict[str, tuple[Path, int, str, tuple[int, ...], int, int]] = {}
        for fname in files:
            path = self.folder / fname
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                lo, hi = info["data_offsets"]
                self.meta[name] = (path, 8 + n, info["dtype"], tuple(info["shape"]), lo, hi)
        self._maps: dict[Path, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.meta

    def names(self) -> list[str]:
        return list(self.meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name][3]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as its numpy dtype (BF16 -> uint16 bits), a view into the memmapped file."""
        if name not in self.meta:
            raise KeyError(f"{self.folder}: no tensor {name!r}")
        path, base, dtype, shape, lo, hi = self.meta[name]
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        buf = self._maps[path][base + lo:base + hi]
        np_dtype = {"BF16": np.uint16, "F32": np.float32, "F16": np.float16}[dtype]
        return buf.view(np_dtype).reshape(shape)

    def bf16(self, name: str) -> np.ndarray:
        """bf16 bits (uint16); float tensors are rounded to bf16."""
        a = self.raw(name)
        return a if a.dtype == np.uint16 else f32_to_bf16(a.astype(np.float32))

    def f32(self, name: str) -> np.ndarray:
        a = self.raw(name)
        return bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def rope_pairs_from_halves(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection reordered per head from HF's rotate-half layout ([x0..x_{d/2}), [x_{d/2}..))
    to the adjacent-pair layout GGML's normal rope rotates ((x0, x1), (x2, x3), ...)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- the tensor plan --------------------------------------------------------------------------------

Item = tuple[str, tuple[int, ...], "gguf.GGMLQuantizationType", Callable[[], np.ndarray]]


class Plan:
    """GGUF tensors in write order: name, numpy shape, type, and a function making the data.

    `dense`: the type of the matrices (BF16, or F32 for a file that holds an f32 checkpoint exactly);
    `experts`: the routed experts' type (the dense type by default; Q8_0 / Q4_0 quantized by the `gguf`
    package's quantizer, whose blocks are llama.cpp's reference layout)."""

    def __init__(self, ck: Checkpoint, dense: "gguf.GGMLQuantizationType" = BF16,
                 experts: Optional["gguf.GGMLQuantizationType"] = None,
                 matrices: Optional["gguf.GGMLQuantizationType"] = None):
        if dense not in (BF16, F32):
            raise ValueError(f"dense type {dense.name}: BF16 or F32")
        self.ck = ck
        self.dense = dense
        self.experts = dense if experts is None else experts
        self.matrices = matrices  # 2-D matrices whose rows are whole blocks of it stored in this type (None: dense)
        self.items: list[Item] = []

    def get(self, hname: str) -> np.ndarray:
        """An HF tensor in the dense type (bf16 bits as uint16, or float32)."""
        return self.ck.bf16(hname) if self.dense == BF16 else self.ck.f32(hname)

    def matrix(self, name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> None:
        q = self.matrices
        if q is not None and len(shape) == 2 and shape[-1] % gguf.GGML_QUANT_SIZES[q][0] == 0:
            self.items.append((name, tuple(shape), q, self._stored_as(q, make, name)))
            return
        self.items.append((name, tuple(shape), self.dense, make))

    def expert_stack(self, name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> None:
        """Stacked experts [E, out, in], made in the dense type and stored in the experts' type."""
        qtype = self.experts
        if qtype == self.dense:
            self.items.append((name, tuple(shape), qtype, make))
            return
        self.items.append((name, tuple(shape), qtype, self._stored_as(qtype, make, name)))

    def _stored_as(self, qtype: "gguf.GGMLQuantizationType", make: Callable[[], np.ndarray], name: str
                   ) -> Callable[[], np.ndarray]:
        """`make` (data in the dense type) converted to `qtype`'s stored form."""

        def stored() -> np.ndarray:
            a = make()
            f32 = bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)
            if qtype == F32:
                return f32
            if qtype == BF16:
                return f32_to_bf16(f32)
            if qtype in K_QUANTS:  # the gguf package has no K-quant quantizer: moescope's (llama.cpp's reference)
                from models.quant.formats import quantize as quantize_rows

                rows = f32.reshape(-1, f32.shape[-1])
                return quantize_rows(rows, K_QUANTS[qtype], name).reshape(*f32.shape[:-1], -1)
            return gguf.quants.quantize(f32, qtype)

        return stored

    def f32(self, name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> None:
        self.items.append((name, tuple(shape), F32, make))

    def copy(self, gname: str, hname: str) -> None:
        self.matrix(gname, self.ck.shape(hname), lambda: self.get(hname))

    def norm(self, gname: str, hname: str) -> None:
        self.f32(gname, self.ck.shape(hname), lambda: self.ck.f32(hname))


def _first(ck: Checkpoint, *names: str) -> str:
    for n in names:
        if n in ck:
            return n
    raise KeyError(f"{ck.folder}: none of {names}")


def _experts(plan: Plan, ck: Checkpoint, i: int, prefixes: tuple[str, ...], names: tuple[str, str, str],
             E: int) -> None:
    """ffn_{gate,up,down}_exps of layer i from either layout; `names` = per-expert (gate, up, down) names."""
    fused = [f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.experts.down_proj"]
    if fused[0] in ck:
        gu, down = fused
        e, f2, h = ck.shape(gu)
        f = f2 // 2
        plan.expert_stack(f"blk.{i}.ffn_gate_exps.weight", (e, f, h), lambda: np.ascontiguousarray(plan.get(gu)[:, :f]))
        plan.expert_stack(f"blk.{i}.ffn_up_exps.weight", (e, f, h), lambda: np.ascontiguousarray(plan.get(gu)[:, f:]))
        plan.expert_stack(f"blk.{i}.ffn_down_exps.weight", ck.shape(down), lambda: plan.get(down))
        return
    base = next(f"model.layers.{i}.{p}.experts" for p in prefixes
                if f"model.layers.{i}.{p}.experts.0.{names[0]}.weight" in ck)
    for kind, hf in zip(("gate", "up", "down"), names):
        first = f"{base}.0.{hf}.weight"
        shape = (E, *ck.shape(first))

        def make(hf=hf, shape=shape) -> np.ndarray:
            out = np.empty(shape, np.uint16 if plan.dense == BF16 else np.float32)
            for e in range(E):
                out[e] = plan.get(f"{base}.{e}.{hf}.weight")
            return out

        plan.expert_stack(f"blk.{i}.ffn_{kind}_exps.weight", shape, make)


def _placeholder_tokens(w: gguf.GGUFWriter, vocab: int, pad: Optional[int]) -> None:
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    toks += [f"tok{i}" for i in range(len(toks), vocab)]
    toks = toks[:vocab]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types[:vocab])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if pad is not None:
        w.add_pad_token_id(int(pad))
    w.add_add_bos_token(False)


def _bpe_tokens(w: gguf.GGUFWriter, tokenizer: dict, c: dict) -> None:
    """A byte-level BPE tokenizer.json (the shipped tiny models') as llama.cpp's `gpt2` tokenizer: tokens by
    id (padded with unused tokens up to the model's vocabulary), merges, added tokens as control tokens."""
    model = tokenizer["model"]
    by_id = {int(i): tok for tok, i in model["vocab"].items()}
    special = {int(t["id"]) for t in tokenizer.get("added_tokens", []) if t.get("special")}
    by_id.update({int(t["id"]): t["content"] for t in tokenizer.get("added_tokens", [])})
    n = max(int(c["vocab_size"]), max(by_id) + 1)
    toks = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL if i in by_id
             else gguf.TokenType.UNUSED for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")  # the GPT-2 split, as tokenizers' ByteLevel pre-tokenizer does
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("pad_token_id", w.add_pad_token_id)):
        if c.get(key) is not None:
            add(int(c[key]))
    w.add_add_bos_token(False)


def _tokens(w: gguf.GGUFWriter, ck: Checkpoint) -> None:
    """The checkpoint's tokenizer.json where it is a BPE one, else placeholder tokens (ids only)."""
    path = ck.folder / "tokenizer.json"
    tokenizer = json.loads(path.read_text()) if path.is_file() else None
    if tokenizer is not None and tokenizer.get("model", {}).get("type") == "BPE":
        _bpe_tokens(w, tokenizer, ck.config)
    else:
        _placeholder_tokens(w, int(ck.config["vocab_size"]), ck.config.get("pad_token_id"))


# llama_ftype of the file: the type most of its bytes are in
FILE_TYPES = {F32: 0, BF16: 32, gguf.GGMLQuantizationType.Q8_0: 7, gguf.GGMLQuantizationType.Q4_0: 2,
              gguf.GGMLQuantizationType.Q4_K: 14, gguf.GGMLQuantizationType.Q6_K: 18}  # Q4_K_S, Q6_K
K_QUANTS = {gguf.GGMLQuantizationType.Q4_K: "q4_k", gguf.GGMLQuantizationType.Q6_K: "q6_k"}


def _common(w: gguf.GGUFWriter, c: dict, n_head_kv: int, file_type: int) -> None:
    w.add_name(f"moescope-random-{c['model_type']}")
    w.add_context_length(int(c.get("max_position_embeddings", 4096)))
    w.add_embedding_length(int(c["hidden_size"]))
    w.add_block_count(int(c["num_hidden_layers"]))
    w.add_feed_forward_length(int(c["intermediate_size"]))
    w.add_head_count(int(c["num_attention_heads"]))
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(int(c["vocab_size"]))
    w.add_file_type(file_type)
    rope = c.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", c.get("rope_theta", 10000.0))))
    if c.get("sliding_window") and c.get("use_sliding_window", True):
        w.add_sliding_window(int(c["sliding_window"]))


def _rope_params(c: dict) -> dict:
    return dict(c.get("rope_parameters") or c.get("rope_scaling") or {})


def _rope_scaling(w: gguf.GGUFWriter, c: dict) -> None:
    rope = _rope_params(c)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return
    if kind != "yarn":
        raise ValueError(f"rope scaling {kind!r} not converted")
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    w.add_rope_scaling_yarn_log_mul(0.1 * float(rope.get("mscale_all_dim") or 0.0))
    if "beta_fast" in rope:
        w.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
    if "beta_slow" in rope:
        w.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))


def _longrope(plan: Plan, w: gguf.GGUFWriter, c: dict) -> None:
    """PhiMoE's long-rope factors as the rope_factors_{long,short} tensors with one magnitude scale, as
    llama.cpp's Phi-3 converter writes them (it computes the scale from the context lengths)."""
    rope = _rope_params(c)
    if (rope.get("rope_type") or rope.get("type")) != "longrope":
        return
    orig, ctx = int(rope["original_max_position_embeddings"]), int(c.get("max_position_embeddings", 4096))
    scale = ctx / orig
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
    for kind in ("long", "short"):
        values = np.asarray(rope[f"{kind}_factor"], np.float32)
        plan.f32(f"rope_factors_{kind}.weight", values.shape, lambda values=values: values)


def _family_keys(plan: Plan, w: gguf.GGUFWriter, c: dict, family: str, absorbed: bool) -> int:
    """The family's metadata; returns the number of routed experts."""
    H, nh = int(c["hidden_size"]), int(c["num_attention_heads"])
    E = int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts"))
    w.add_expert_count(E)
    w.add_expert_used_count(int(c["num_experts_per_tok"]))
    if family in ("mixtral", "olmoe", "phimoe"):
        w.add_rope_dimension_count(int(c.get("head_dim") or H // nh))
        if family == "olmoe" and c.get("clip_qkv") is not None:
            w.add_clamp_kqv(float(c["clip_qkv"]))
        if family == "phimoe":
            _longrope(plan, w, c)
        return E
    if family == "qwen3_moe":
        hd = int(c.get("head_dim") or H // nh)
        w.add_expert_feed_forward_length(int(c["moe_intermediate_size"]))
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_rope_dimension_count(hd)
        w.add_expert_weights_norm(bool(c.get("norm_topk_prob", False)))  # llama.cpp's qwen3moe always renormalises
        return E
    nope, rope_d, vd = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    kv_rank = int(c["kv_lora_rank"])
    w.add_leading_dense_block_count(int(c.get("first_k_dense_replace", 0)))
    w.add_expert_feed_forward_length(int(c["moe_intermediate_size"]))
    w.add_expert_shared_count(int(c.get("n_shared_experts") or 0))
    w.add_expert_weights_scale(float(c.get("routed_scaling_factor", 1.0)))
    v3 = family == "deepseek_v3"
    w.add_expert_weights_norm(bool(c.get("norm_topk_prob", False)) and v3)  # V2 never renormalises
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(int(c["q_lora_rank"]))
    w.add_kv_lora_rank(kv_rank)
    w.add_rope_dimension_count(rope_d)
    if absorbed:  # one latent kv head of rank + rope dims, shared by all query heads
        w.add_key_length(kv_rank + rope_d)
        w.add_value_length(kv_rank)
        w.add_key_length_mla(nope + rope_d)
        w.add_value_length_mla(vd)
    else:
        w.add_key_length(nope + rope_d)
        w.add_value_length(vd)
    grouped = v3 or c.get("topk_method") == "group_limited_greedy"
    if int(c.get("n_group") or 1) > 1 and grouped:
        w.add_expert_group_count(int(c["n_group"]))
        w.add_expert_group_used_count(int(c["topk_group"]))
    _rope_scaling(w, c)
    return E


def _mla(plan: Plan, c: dict, i: int, a: str, mla: str) -> None:
    nh, kv_rank = int(c["num_attention_heads"]), int(c["kv_lora_rank"])
    nope, vd = int(c["qk_nope_head_dim"]), int(c["v_head_dim"])
    if c.get("q_lora_rank"):
        plan.copy(f"blk.{i}.attn_q_a.weight", f"{a}.q_a_proj.weight")
        plan.norm(f"blk.{i}.attn_q_a_norm.weight", f"{a}.q_a_layernorm.weight")
        plan.copy(f"blk.{i}.attn_q_b.weight", f"{a}.q_b_proj.weight")
    else:
        plan.copy(f"blk.{i}.attn_q.weight", f"{a}.q_proj.weight")
    plan.copy(f"blk.{i}.attn_kv_a_mqa.weight", f"{a}.kv_a_proj_with_mqa.weight")
    plan.norm(f"blk.{i}.attn_kv_a_norm.weight", f"{a}.kv_a_layernorm.weight")
    kvb = f"{a}.kv_b_proj.weight"
    if mla == "joint":
        plan.copy(f"blk.{i}.attn_kv_b.weight", kvb)
        return

    def k_b() -> np.ndarray:  # [nh, nope, rank] -> [nh, rank, nope]
        per_head = plan.get(kvb).reshape(nh, nope + vd, kv_rank)
        return np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))

    def v_b() -> np.ndarray:  # [nh, vd, rank]
        return np.ascontiguousarray(plan.get(kvb).reshape(nh, nope + vd, kv_rank)[:, nope:])

    plan.matrix(f"blk.{i}.attn_k_b.weight", (nh, kv_rank, nope), k_b)
    plan.matrix(f"blk.{i}.attn_v_b.weight", (nh, vd, kv_rank), v_b)


def _gqa(plan: Plan, ck: Checkpoint, c: dict, family: str, i: int, a: str) -> None:
    nh = int(c["num_attention_heads"])
    nkv = int(c.get("num_key_value_heads") or nh)
    q, k = f"{a}.q_proj.weight", f"{a}.k_proj.weight"
    if family == "mixtral":
        plan.matrix(f"blk.{i}.attn_q.weight", ck.shape(q), lambda: rope_pairs_from_halves(plan.get(q), nh))
        plan.matrix(f"blk.{i}.attn_k.weight", ck.shape(k), lambda: rope_pairs_from_halves(plan.get(k), nkv))
    else:
        plan.copy(f"blk.{i}.attn_q.weight", q)
        plan.copy(f"blk.{i}.attn_k.weight", k)
    plan.copy(f"blk.{i}.attn_v.weight", f"{a}.v_proj.weight")
    for proj in ("q", "k", "v", "o"):
        bias = f"{a}.{proj}_proj.bias"
        if bias in ck:
            plan.norm(f"blk.{i}.attn_{'output' if proj == 'o' else proj}.bias", bias)
    if family in ("qwen3_moe", "olmoe"):
        plan.norm(f"blk.{i}.attn_q_norm.weight", f"{a}.q_norm.weight")
        plan.norm(f"blk.{i}.attn_k_norm.weight", f"{a}.k_norm.weight")


def _norm_with_bias(plan: Plan, ck: Checkpoint, gname: str, hname: str) -> None:
    plan.norm(f"{gname}.weight", f"{hname}.weight")
    if f"{hname}.bias" in ck:  # PhiMoE's LayerNorms
        plan.norm(f"{gname}.bias", f"{hname}.bias")


def _ffn(plan: Plan, ck: Checkpoint, c: dict, family: str, i: int, E: int) -> None:
    p = f"model.layers.{i}"
    if f"{p}.mlp.gate_proj.weight" in ck:  # a dense layer (DeepSeek's first ones, Qwen3's mlp_only_layers)
        for kind in ("gate", "up", "down"):
            plan.copy(f"blk.{i}.ffn_{kind}.weight", f"{p}.mlp.{kind}_proj.weight")
        return
    if family in ("mixtral", "phimoe"):
        router = _first(ck, f"{p}.block_sparse_moe.gate.weight", f"{p}.mlp.gate.weight", f"{p}.mlp.router.weight")
        names = ("w1", "w3", "w2")
        prefixes: tuple[str, ...] = ("block_sparse_moe", "mlp")
    else:
        router = f"{p}.mlp.gate.weight"
        names = ("gate_proj", "up_proj", "down_proj")
        prefixes = ("mlp",)
    plan.norm(f"blk.{i}.ffn_gate_inp.weight", router)
    if f"{p}.mlp.gate.e_score_correction_bias" in ck:  # DeepSeek-V3
        plan.norm(f"blk.{i}.exp_probs_b.bias", f"{p}.mlp.gate.e_score_correction_bias")
    _experts(plan, ck, i, prefixes, names, E)
    if family.startswith("deepseek") and c.get("n_shared_experts"):
        for kind in ("gate", "up", "down"):
            plan.copy(f"blk.{i}.ffn_{kind}_shexp.weight", f"{p}.mlp.shared_experts.{kind}_proj.weight")


def build_plan(ck: Checkpoint, w: gguf.GGUFWriter, mla: str = "split", dense: "gguf.GGMLQuantizationType" = BF16,
               experts: Optional["gguf.GGMLQuantizationType"] = None,
               matrices: Optional["gguf.GGMLQuantizationType"] = None, file_type: Optional[int] = None) -> Plan:
    """The metadata of `ck` written to `w`, and the plan of its tensors; `file_type` (llama_ftype) defaults to
    the type of the routed experts."""
    c = ck.config
    family = c["model_type"]
    if family not in ARCH:
        raise ValueError(f"{ck.folder}: model_type {family!r} not supported (supported: {sorted(ARCH)})")
    plan = Plan(ck, dense, experts, matrices)
    L, nh = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    nkv = int(c.get("num_key_value_heads") or nh)
    mla_model = family.startswith("deepseek")
    absorbed = mla_model and mla == "split"
    _common(w, c, 1 if absorbed else nkv, FILE_TYPES[plan.experts] if file_type is None else file_type)
    plan.copy("token_embd.weight", "model.embed_tokens.weight")
    E = _family_keys(plan, w, c, family, absorbed)
    for i in range(L):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        _norm_with_bias(plan, ck, f"blk.{i}.attn_norm", f"{p}.input_layernorm")
        if mla_model:
            _mla(plan, c, i, a, mla)
        else:
            _gqa(plan, ck, c, family, i, a)
        plan.copy(f"blk.{i}.attn_output.weight", f"{a}.o_proj.weight")
        _norm_with_bias(plan, ck, f"blk.{i}.ffn_norm", f"{p}.post_attention_layernorm")
        _ffn(plan, ck, c, family, i, E)
    _norm_with_bias(plan, ck, "output_norm", "model.norm")
    if "lm_head.weight" in ck and not c.get("tie_word_embeddings", False):
        plan.copy("output.weight", "lm_head.weight")
        if "lm_head.bias" in ck:
            plan.norm("output.bias", "lm_head.bias")
    return plan


def _stored(qtype: "gguf.GGMLQuantizationType", shape: tuple[int, ...]) -> tuple[np.dtype, tuple[int, ...], int]:
    """(numpy dtype, numpy shape, bytes) of a tensor of element shape `shape` stored as `qtype`."""
    if qtype == BF16:
        return np.dtype(np.uint16), shape, 2 * int(np.prod(shape))
    if qtype == F32:
        return np.dtype(np.float32), shape, 4 * int(np.prod(shape))
    byte_shape = tuple(gguf.quant_shape_to_byte_shape(shape, qtype))
    return np.dtype(np.uint8), byte_shape, int(np.prod(byte_shape))


def write_plan(w: gguf.GGUFWriter, plan: Plan, verbose: bool = False,
               on_bytes: Optional[Callable[[object, int], None]] = None) -> None:
    """Write the tensor infos and then each tensor of `plan` (made one at a time) to `w`, and close it;
    `on_bytes(file, n)` is called after each tensor's `n` bytes are written."""
    for name, shape, qtype, _ in plan.items:
        dtype, byte_shape, nbytes = _stored(qtype, shape)
        w.add_tensor_info(name, byte_shape, dtype, nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, qtype, make in plan.items:
        arr = np.ascontiguousarray(make())
        dtype, byte_shape, _ = _stored(qtype, shape)
        if arr.dtype != dtype or tuple(arr.shape) != tuple(byte_shape):
            raise AssertionError(f"{name}: made {arr.dtype}{arr.shape}, planned {dtype}{byte_shape}")
        w.write_tensor_data(arr)
        if on_bytes is not None:
            on_bytes(w.fout[0], arr.nbytes)
        if verbose:
            print(f"  {name} {shape} {qtype.name}", flush=True)
    w.close()


def convert(src: str | Path, dst: str | Path, mla: str = "split", verbose: bool = False, dense: str = "bf16",
            experts: Optional[str] = None, matrices: Optional[str] = None) -> dict:
    """Write `dst` from the checkpoint folder `src`; returns {"bytes", "seconds", "tensors"}.

    `dense`: bf16 or f32 matrices; `experts`: the routed experts' type (f32, bf16, q8_0, q4_0, q4_k, q6_k; the
    dense type by default; the K-quants need moescope's quantizer, models.quant.formats, on the path); `matrices`:
    a block type for the 2-D matrices (embedding, attention, dense MLPs, LM head) whose rows are whole blocks of it
    (the others stay `dense`), as llama.cpp's presets store them."""
    t0 = time.perf_counter()
    ck = Checkpoint(src)
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), ARCH.get(ck.config["model_type"], "?"))
    w.add_custom_alignment(ALIGNMENT)
    plan = build_plan(ck, w, mla=mla, dense=TYPES[dense], experts=None if experts is None else TYPES[experts],
                      matrices=None if matrices is None else TYPES[matrices])
    _tokens(w, ck)
    write_plan(w, plan, verbose)
    tmp.replace(dst)
    used = {n for n in ck.names() if not n.endswith("rotary_emb.inv_freq")}
    return {"bytes": dst.stat().st_size, "seconds": time.perf_counter() - t0, "tensors": len(plan.items),
            "source_tensors": len(used)}


TYPES = {"f32": F32, "bf16": BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_k": gguf.GGMLQuantizationType.Q4_K, "q6_k": gguf.GGMLQuantizationType.Q6_K}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--mla", choices=("split", "joint"), default="split",
                    help="DeepSeek-V2/V3: one attn_kv_b (joint) or attn_k_b + attn_v_b (split)")
    ap.add_argument("--dense", choices=("bf16", "f32"), default="bf16", help="type of the dense matrices")
    ap.add_argument("--experts", choices=sorted(TYPES), help="type of the routed experts (default: --dense)")
    ap.add_argument("--matrices", choices=sorted(TYPES), help="type of the 2-D matrices whose rows are whole blocks")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    info = convert(a.checkpoint, a.out, mla=a.mla, verbose=a.verbose, dense=a.dense, experts=a.experts,
                   matrices=a.matrices)
    print(json.dumps(info))


if __name__ == "__main__":
    sys.exit(main())
