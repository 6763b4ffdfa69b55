"""Convert a bf16 HF MoE checkpoint (sharded safetensors) into a BF16 GGUF that llama.cpp runs.

    python -m engine.bench.peers.to_gguf CKPT_DIR OUT.gguf [--mla split|joint]

Standalone on purpose: it needs only numpy and the `gguf` package (no torch, no jax, no moescope
imports), so it runs in the venv that holds llama-cpp-python. Safetensors files are read through
their JSON header and a numpy memmap, bf16 kept as raw uint16 bits; tensors are streamed into the
GGUF one at a time (memory stays about one stacked expert tensor).

Families (HF `model_type` -> llama.cpp architecture):
  mixtral   -> llama (with experts); q/k rows permuted from HF's rotate-half order to GGML's pairwise rope
  qwen3_moe -> qwen3moe (NeoX rope: no permutation; per-head q/k norms)
  deepseek_v2 -> deepseek2 (MLA; `--mla split`, the default, writes kv_b_proj as the per-head attn_k_b /
               attn_v_b pair with one latent kv head, which llama.cpp runs as absorbed MLA (its kv cache holds
               rank + rope dims per token); `--mla joint` writes one attn_kv_b, run as plain multi-head
               attention. Without q-LoRA, llama.cpp (the build in llama-cpp-python 0.3.16) only accepts
               the model at 27 layers: it tells DeepSeek-V2-Lite from V2 by the layer count.)
Both the per-expert layout (`experts.E.w1` / `experts.E.gate_proj`) and the fused transformers-v5 layout
(`experts.gate_up_proj` [E, 2F, H], `experts.down_proj` [E, H, F]) are read. Norm weights and the router
are written F32, everything else BF16. The vocabulary is placeholder tokens (ids only): the peers feed
token ids, never text.
"""

from __future__ import annotations

import argparse
import json
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

ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "deepseek_v2": "deepseek2"}


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
    """GGUF tensors in write order: name, numpy shape, type, and a function making the data."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck
        self.items: list[Item] = []

    def bf16(self, name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> None:
        self.items.append((name, tuple(shape), BF16, make))

    def f32(self, name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> None:
        self.items.append((name, tuple(shape), F32, make))

    def copy(self, gname: str, hname: str) -> None:
        self.bf16(gname, self.ck.shape(hname), lambda: self.ck.bf16(hname))

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
        plan.bf16(f"blk.{i}.ffn_gate_exps.weight", (e, f, h), lambda: np.ascontiguousarray(ck.bf16(gu)[:, :f]))
        plan.bf16(f"blk.{i}.ffn_up_exps.weight", (e, f, h), lambda: np.ascontiguousarray(ck.bf16(gu)[:, f:]))
        plan.copy(f"blk.{i}.ffn_down_exps.weight", down)
        return
    base = next(f"model.layers.{i}.{p}.experts" for p in prefixes
                if f"model.layers.{i}.{p}.experts.0.{names[0]}.weight" in ck)
    for kind, hf in zip(("gate", "up", "down"), names):
        first = f"{base}.0.{hf}.weight"
        shape = (E, *ck.shape(first))

        def make(hf=hf, shape=shape) -> np.ndarray:
            out = np.empty(shape, np.uint16)
            for e in range(E):
                out[e] = ck.bf16(f"{base}.{e}.{hf}.weight")
            return out

        plan.bf16(f"blk.{i}.ffn_{kind}_exps.weight", shape, make)


def _tokens(w: gguf.GGUFWriter, vocab: int) -> None:
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
    w.add_add_bos_token(False)


def _common(w: gguf.GGUFWriter, c: dict, n_head_kv: int) -> None:
    w.add_name(f"moescope-random-{c['model_type']}")
    w.add_context_length(int(c.get("max_position_embeddings", 4096)))
    w.add_embedding_length(int(c["hidden_size"]))
    w.add_block_count(int(c["num_hidden_layers"]))
    w.add_feed_forward_length(int(c["intermediate_size"]))
    w.add_head_count(int(c["num_attention_heads"]))
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(int(c["vocab_size"]))
    w.add_file_type(FILE_TYPE_BF16)
    rope = c.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", c.get("rope_theta", 10000.0))))


def _rope_scaling(w: gguf.GGUFWriter, c: dict) -> None:
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
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


def build_plan(ck: Checkpoint, w: gguf.GGUFWriter, mla: str = "split") -> Plan:
    c = ck.config
    family = c["model_type"]
    if family not in ARCH:
        raise ValueError(f"{ck.folder}: model_type {family!r} not supported (supported: {sorted(ARCH)})")
    plan = Plan(ck)
    L, nh = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    nkv = int(c.get("num_key_value_heads") or nh)
    absorbed = family == "deepseek_v2" and mla == "split"
    _common(w, c, 1 if absorbed else nkv)
    H = int(c["hidden_size"])
    plan.copy("token_embd.weight", "model.embed_tokens.weight")
    if family == "mixtral":
        E = int(c["num_local_experts"])
        w.add_expert_count(E)
        w.add_expert_used_count(int(c["num_experts_per_tok"]))
        w.add_rope_dimension_count(int(c.get("head_dim") or H // nh))
    elif family == "qwen3_moe":
        E = int(c["num_experts"])
        hd = int(c.get("head_dim") or H // nh)
        w.add_expert_count(E)
        w.add_expert_used_count(int(c["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(int(c["moe_intermediate_size"]))
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_rope_dimension_count(hd)
        if not c.get("norm_topk_prob", True):
            raise ValueError("llama.cpp's qwen3moe always renormalises the top-k weights; norm_topk_prob=false differs")
        sparse_step = int(c.get("decoder_sparse_step", 1))
        if sparse_step != 1 or c.get("mlp_only_layers"):
            raise ValueError("qwen3moe with dense layers (decoder_sparse_step / mlp_only_layers) not converted")
    else:  # deepseek_v2
        E = int(c["n_routed_experts"])
        nope, rope_d, vd = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
        kv_rank = int(c["kv_lora_rank"])
        w.add_leading_dense_block_count(int(c.get("first_k_dense_replace", 0)))
        w.add_expert_count(E)
        w.add_expert_used_count(int(c["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(int(c["moe_intermediate_size"]))
        w.add_expert_shared_count(int(c.get("n_shared_experts") or 0))
        w.add_expert_weights_scale(float(c.get("routed_scaling_factor", 1.0)))
        w.add_expert_weights_norm(bool(c.get("norm_topk_prob", False)))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
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
        if int(c.get("n_group") or 1) > 1 and c.get("topk_method") == "group_limited_greedy":
            w.add_expert_group_count(int(c["n_group"]))
            w.add_expert_group_used_count(int(c["topk_group"]))
        _rope_scaling(w, c)
    for i in range(L):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        plan.norm(f"blk.{i}.attn_norm.weight", f"{p}.input_layernorm.weight")
        if family == "deepseek_v2":
            if c.get("q_lora_rank"):
                plan.copy(f"blk.{i}.attn_q_a.weight", f"{a}.q_a_proj.weight")
                plan.norm(f"blk.{i}.attn_q_a_norm.weight", f"{a}.q_a_layernorm.weight")
                plan.copy(f"blk.{i}.attn_q_b.weight", f"{a}.q_b_proj.weight")
            else:
                plan.copy(f"blk.{i}.attn_q.weight", f"{a}.q_proj.weight")
            plan.copy(f"blk.{i}.attn_kv_a_mqa.weight", f"{a}.kv_a_proj_with_mqa.weight")
            plan.norm(f"blk.{i}.attn_kv_a_norm.weight", f"{a}.kv_a_layernorm.weight")
            kvb = f"{a}.kv_b_proj.weight"
            if mla == "split":
                def k_b(kvb=kvb) -> np.ndarray:  # [nh, nope, rank] -> [nh, rank, nope]
                    per_head = ck.bf16(kvb).reshape(nh, nope + vd, kv_rank)
                    return np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))

                def v_b(kvb=kvb) -> np.ndarray:  # [nh, vd, rank]
                    return np.ascontiguousarray(ck.bf16(kvb).reshape(nh, nope + vd, kv_rank)[:, nope:])

                plan.bf16(f"blk.{i}.attn_k_b.weight", (nh, kv_rank, nope), k_b)
                plan.bf16(f"blk.{i}.attn_v_b.weight", (nh, vd, kv_rank), v_b)
            else:
                plan.copy(f"blk.{i}.attn_kv_b.weight", kvb)
        else:
            q, k = f"{a}.q_proj.weight", f"{a}.k_proj.weight"
            if family == "mixtral":
                plan.bf16(f"blk.{i}.attn_q.weight", ck.shape(q), lambda q=q: rope_pairs_from_halves(ck.bf16(q), nh))
                plan.bf16(f"blk.{i}.attn_k.weight", ck.shape(k), lambda k=k: rope_pairs_from_halves(ck.bf16(k), nkv))
            else:
                plan.copy(f"blk.{i}.attn_q.weight", q)
                plan.copy(f"blk.{i}.attn_k.weight", k)
            plan.copy(f"blk.{i}.attn_v.weight", f"{a}.v_proj.weight")
            if family == "qwen3_moe":
                plan.norm(f"blk.{i}.attn_q_norm.weight", f"{a}.q_norm.weight")
                plan.norm(f"blk.{i}.attn_k_norm.weight", f"{a}.k_norm.weight")
        plan.copy(f"blk.{i}.attn_output.weight", f"{a}.o_proj.weight")
        plan.norm(f"blk.{i}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight")
        if family == "deepseek_v2" and i < int(c.get("first_k_dense_replace", 0)):
            for kind in ("gate", "up", "down"):
                plan.copy(f"blk.{i}.ffn_{kind}.weight", f"{p}.mlp.{kind}_proj.weight")
            continue
        if family == "mixtral":
            router = _first(ck, f"{p}.block_sparse_moe.gate.weight", f"{p}.mlp.gate.weight")
            names = ("w1", "w3", "w2")
            prefixes: tuple[str, ...] = ("block_sparse_moe", "mlp")
        else:
            router = f"{p}.mlp.gate.weight"
            names = ("gate_proj", "up_proj", "down_proj")
            prefixes = ("mlp",)
        plan.norm(f"blk.{i}.ffn_gate_inp.weight", router)
        _experts(plan, ck, i, prefixes, names, E)
        if family == "deepseek_v2" and c.get("n_shared_experts"):
            for kind in ("gate", "up", "down"):
                plan.copy(f"blk.{i}.ffn_{kind}_shexp.weight", f"{p}.mlp.shared_experts.{kind}_proj.weight")
    plan.norm("output_norm.weight", "model.norm.weight")
    if "lm_head.weight" in ck:
        plan.copy("output.weight", "lm_head.weight")
    return plan


def convert(src: str | Path, dst: str | Path, mla: str = "split", verbose: bool = False) -> dict:
    """Write `dst` from the checkpoint folder `src`; returns {"bytes", "seconds", "tensors"}."""
    t0 = time.perf_counter()
    ck = Checkpoint(src)
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), ARCH.get(ck.config["model_type"], "?"))
    plan = build_plan(ck, w, mla=mla)
    _tokens(w, int(ck.config["vocab_size"]))
    for name, shape, qtype, _ in plan.items:
        item = np.dtype(np.uint16 if qtype == BF16 else np.float32)
        w.add_tensor_info(name, shape, item, int(np.prod(shape)) * item.itemsize, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, qtype, make in plan.items:
        arr = np.ascontiguousarray(make())
        want = np.uint16 if qtype == BF16 else np.float32
        if arr.dtype != want or tuple(arr.shape) != tuple(shape):
            raise AssertionError(f"{name}: made {arr.dtype}{arr.shape}, planned {np.dtype(want)}{shape}")
        w.write_tensor_data(arr)
        if verbose:
            print(f"  {name} {shape} {qtype.name}", flush=True)
    w.close()
    tmp.replace(dst)
    used = {n for n in ck.names() if not n.endswith("rotary_emb.inv_freq")}
    return {"bytes": dst.stat().st_size, "seconds": time.perf_counter() - t0, "tensors": len(plan.items),
            "source_tensors": len(used)}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--mla", choices=("split", "joint"), default="split",
                    help="DeepSeek-V2: one attn_kv_b (joint) or attn_k_b + attn_v_b (split)")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    info = convert(a.checkpoint, a.out, mla=a.mla, verbose=a.verbose)
    print(json.dumps(info))


if __name__ == "__main__":
    sys.exit(main())

