"""Random-weight GGUF files of released MoE models at full size, in the types llama.cpp's presets write.

    python -m engine.bench.full_depth_gguf --family qwen3_moe --type q4_k_m --out /tmp/fulldepth
    python -m engine.bench.full_depth_gguf --family deepseek_v2 --type q8_0 --out /tmp/fulldepth

A released Q4_K_M / Q8_0 file is what a practitioner serves, but its weights cannot be downloaded here and
quantizing 30B random floats with the reference K-quant search would take hours on 2 cores. So the file is
written directly as random ggml blocks: names, metadata and tensor order are those llama.cpp's own converter
writes for the architecture (`engine.bench.peers.to_gguf.build_plan`, fed a checkpoint that only has names
and shapes), each tensor gets the type llama.cpp's quantizer gives it under the preset (`preset_type`), and
its blocks are random quants with small finite f16 scales (`random_tensor`): every weight is
`d * scale * (q - zero)` with the scales chosen so that weights have a spread of about 0.02, as the HF
initialisers give. Norms are ones, routers random f32. Writing streams one tensor at a time (memory: one
stacked expert tensor, ~200 MB) at the random generator's rate (SFC64, ~1 GB/s on one core).

The vocabulary is a synthetic byte-level BPE (the 256 GPT-2 byte characters, then every pair of them, then
pair + byte tokens, in merge order) of the model's size with its special tokens at their real ids (Qwen3's
<|endoftext|> / <|im_start|> / <|im_end|>, DeepSeek's begin / end of sentence), written as llama.cpp's
`gpt2` tokenizer with the GPT-2 split (`pre = default`): both llama.cpp and `models.gguf_tokenizer` load it.

Presets (`--type`): `q8_0` (llama.cpp's Q8_0: every matrix Q8_0) and `q4_k_m` (llama.cpp's Q4_K_M: Q4_K by
default; output.weight Q6_K; attn_v and every ffn_down (routed, shared, dense) Q6_K in the layers
`use_more_bits` picks; rows that are not whole 256-weight blocks fall back to Q5_0 / Q8_0). Routers
(`ffn_gate_inp`), norms and other vectors stay F32, as llama.cpp keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import gguf
import numpy as np

from engine.bench.peers import to_gguf
from models.quant.experts import use_more_bits  # llama.cpp's rule for the layers whose attn_v / ffn_down get Q6_K

Q = gguf.GGMLQuantizationType
PRESETS = ("q8_0", "q4_k_m")
FILE_TYPE = {"q8_0": 7, "q4_k_m": 15}  # llama_ftype: LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_Q4_K_M
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}  # llama.cpp's type for rows that are not whole K-quant blocks
STD = 0.02  # the spread of a random weight (HF's initialiser range)

# released files the sizes are checked against (bytes as their model cards / hubs list them)
RELEASED = {("qwen3_moe", "q4_k_m"): ("Qwen3-30B-A3B-Q4_K_M.gguf", 18.6e9),
            ("deepseek_v2", "q8_0"): ("DeepSeek-V2-Lite-Chat.Q8_0.gguf", 16.7e9)}
FULL_DEPTH = {"qwen3_moe": 48, "deepseek_v2": 27}
SPECIAL = {  # family -> (id, text) of its special tokens at their released ids
    "qwen3_moe": ((151643, "<|endoftext|>"), (151644, "<|im_start|>"), (151645, "<|im_end|>")),
    "deepseek_v2": ((100000, "<｜begin▁of▁sentence｜>"), (100001, "<｜end▁of▁sentence｜>")),
}


# ---- which type llama.cpp's preset gives a tensor ---------------------------------------------------


def preset_type(name: str, shape: tuple[int, ...], preset: str, n_layer: int) -> Q:
    """The ggml type llama.cpp's `preset` quantizer stores tensor `name` (numpy shape `shape`) in."""
    if len(shape) < 2 or "ffn_gate_inp" in name or name.endswith(".bias") or "norm" in name:
        return Q.F32
    if preset == "q8_0":
        want = Q.Q8_0
    elif name == "output.weight":
        want = Q.Q6_K
    else:
        m = re.match(r"blk\.(\d+)\.", name)
        more = m is not None and use_more_bits(int(m.group(1)), n_layer)
        want = Q.Q6_K if more and ("attn_v." in name or "ffn_down" in name) else Q.Q4_K
    block = gguf.GGML_QUANT_SIZES[want][0]
    return want if shape[-1] % block == 0 else FALLBACK[want]


# ---- random blocks ----------------------------------------------------------------------------------


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_tensor(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random weights of numpy shape `shape` stored as `qtype`: the stored array (uint8 blocks for quantized
    types, float32 otherwise), every block's quants random and its f16 scales small and finite."""
    if qtype == Q.F32:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(STD))
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) // elems
    raw = rng.bit_generator.random_raw((n * size + 7) // 8)
    b = raw.view(np.uint8)[:n * size].reshape(n, size)
    jitter = rng.uniform(0.5, 1.5, n).astype(np.float32)  # per-block scale spread
    if qtype == Q.Q8_0:  # f16 d, 32 int8: w = d * q, q uniform in [-128, 127] (std 73.9)
        b[:, 0:2] = _f16_bytes(jitter * np.float32(STD / 73.9))
    elif qtype == Q.Q5_0:  # f16 d, 4 bytes of fifth bits, 16 of nibbles: w = d * (q - 16), q in [0, 31]
        b[:, 0:2] = _f16_bytes(jitter * np.float32(STD / 9.2))
    elif qtype == Q.Q4_K:  # f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
        sc = rng.integers(1, 9, (n, 8), dtype=np.uint8)  # per 32-weight sub-block: scale = min = sc
        d = jitter * np.float32(STD / (4.5 * 4.6))
        b[:, 0:2], b[:, 2:4] = _f16_bytes(d), _f16_bytes(8 * d)  # w = d*sc*q - 8d*sc = d*sc*(q - 8)
        b[:, 4:8], b[:, 8:12] = sc[:, :4], sc[:, :4]
        b[:, 12:16] = sc[:, 4:] | (sc[:, 4:] << 4)
    elif qtype == Q.Q6_K:  # 128 low nibbles, 64 high pairs, 16 int8 scales, f16 d: w = d * sc * (q - 32)
        b[:, 192:208] = rng.integers(1, 9, (n, 16), dtype=np.uint8)
        b[:, 208:210] = _f16_bytes(jitter * np.float32(STD / (4.5 * 18.5)))
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return b.reshape(to_gguf._stored(qtype, shape)[1])


def ones(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    return np.ones(shape, np.float32)


# ---- a vocabulary both loaders take -------------------------------------------------------------------


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value (byte-level BPE's alphabet), by byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def synthetic_tokenizer(vocab: int, special: tuple[tuple[int, str], ...]) -> dict:
    """A tokenizer.json-like dict: byte-level BPE over `vocab` ids, the special tokens at their ids and every id
    below the first special one a merge product (bytes, then byte pairs, then pair + byte)."""
    first = min(i for i, _ in special) if special else vocab
    alpha = byte_chars()
    tokens: list[str] = list(alpha)
    merges: list[str] = []
    for a in alpha:
        for c in alpha:
            if len(tokens) >= first:
                break
            tokens.append(a + c)
            merges.append(f"{a} {c}")
    pair = 0
    while len(tokens) < first:
        left = tokens[256 + pair // 256]
        c = alpha[pair % 256]
        tokens.append(left + c)
        merges.append(f"{left} {c}")
        pair += 1
    return {"model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
            "added_tokens": [{"id": i, "content": text, "special": True} for i, text in special]}


def special_tokens(config: dict) -> tuple[tuple[int, str], ...]:
    """The family's special tokens at their released ids; in a smaller vocabulary (a test model) at its last ids,
    with the config's bos / eos / pad ids moved with them."""
    sp = SPECIAL.get(config["model_type"], ())
    vocab = int(config["vocab_size"])
    if all(i < vocab for i, _ in sp):
        return sp
    moved = {i: vocab - len(sp) + j for j, (i, _) in enumerate(sp)}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            config[key] = moved.get(int(config[key]), min(int(config[key]), vocab - 1))
    return tuple((moved[i], text) for i, text in sp)


# ---- the file ------------------------------------------------------------------------------------------


class ShapesOnly:
    """What `to_gguf.build_plan` reads of a checkpoint, from the tensor names and shapes alone (no weights)."""

    def __init__(self, config: dict, shapes: dict[str, tuple[int, ...]]):
        self.config = config
        self.folder = Path("<random>")
        self.meta = shapes

    def __contains__(self, name: str) -> bool:
        return name in self.meta

    def names(self) -> list[str]:
        return list(self.meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name]


def model_config(family: str, layers: Optional[int] = None, **changes):
    """The released model's `ModelConfig` (conf/model) at `layers` depth (its full depth by default)."""
    from engine.bench.real_width import real_width_config

    return real_width_config(family, FULL_DEPTH[family] if layers is None else layers, **changes)


def write(cfg, preset: str, dst: str | Path, seed: int = 0, verbose: bool = False,
          drop_cache: bool = True, alignment: int = to_gguf.ALIGNMENT) -> dict:
    """Write `cfg` (a moescope ModelConfig) as a random-weight GGUF in `preset`'s types; returns a summary.

    `alignment` (`general.alignment`, GGUF's default 32): 64 by default, because XLA:CPU aliases a host buffer
    only at a 64-byte-aligned address; with 32, every tensor lies 32 bytes off whenever the data section does
    (all tensor sizes here are multiples of 64), and moescope's expert views of the mapping are then copied.
    `drop_cache`: flush each GiB written and drop it from the page cache (a full-size file would otherwise
    push every other process's pages out while it is written)."""
    from engine.bench.real_width import hf_config_dict, tensor_specs

    if preset not in PRESETS:
        raise ValueError(f"--type {preset!r}: one of {', '.join(PRESETS)}")
    t0 = time.perf_counter()
    config = hf_config_dict(cfg)
    ck = ShapesOnly(config, {s.name: tuple(s.shape) for s in tensor_specs(cfg, "fused")})
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), to_gguf.ARCH[config["model_type"]])
    plan = to_gguf.build_plan(ck, w, file_type=FILE_TYPE[preset])  # type: ignore[arg-type]
    if alignment != gguf.GGUF_DEFAULT_ALIGNMENT:
        w.add_custom_alignment(alignment)
    to_gguf._bpe_tokens(w, synthetic_tokenizer(cfg.vocab_size, special_tokens(config)), config)
    rng = np.random.Generator(np.random.SFC64(seed))
    items = []
    for name, shape, _, _ in plan.items:
        qtype = preset_type(name, shape, preset, cfg.num_hidden_layers)
        make: Callable = ones if qtype == Q.F32 and re.search(r"norm", name) else random_tensor
        items.append((name, shape, qtype, lambda qtype=qtype, shape=shape, make=make: make(qtype, shape, rng)))
    plan.items = items
    types: dict[str, int] = {}
    for name, shape, qtype, _ in items:
        types[qtype.name] = types.get(qtype.name, 0) + to_gguf._stored(qtype, shape)[2]
    to_gguf.write_plan(w, plan, verbose=verbose, on_bytes=_dropper(drop_cache))
    tmp.replace(dst)
    released = RELEASED.get((config["model_type"], preset))
    size = dst.stat().st_size
    return {"file": str(dst), "bytes": size, "seconds": round(time.perf_counter() - t0, 1),
            "tensors": len(items), "bytes_by_type": types,
            "released": None if released is None else {"name": released[0], "bytes": released[1],
                                                        "ratio": round(size / released[1], 4)}}


def _dropper(enabled: bool) -> Optional[Callable]:
    """A `write_plan` hook: every GiB, flush the file and drop its written pages from the page cache."""
    if not enabled or not hasattr(os, "posix_fadvise"):
        return None
    state = {"since": 0}

    def hook(fout, nbytes: int) -> None:
        state["since"] += nbytes
        if state["since"] >= 1 << 30:
            fout.flush()
            os.fdatasync(fout.fileno())
            os.posix_fadvise(fout.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            state["since"] = 0

    return hook


def default_path(out: str | Path, family: str, preset: str, layers: int) -> Path:
    return Path(out) / f"{family}-L{layers}-{preset}-random.gguf"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(FULL_DEPTH), required=True)
    ap.add_argument("--type", choices=PRESETS, required=True)
    ap.add_argument("--layers", type=int, help="decoder layers (default: the released model's)")
    ap.add_argument("--out", required=True, help="folder for the file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alignment", type=int, default=to_gguf.ALIGNMENT, help="general.alignment (GGUF's default: 32)")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    cfg = model_config(a.family, a.layers)
    info = write(cfg, a.type, default_path(a.out, a.family, a.type, cfg.num_hidden_layers), a.seed, a.verbose,
                 alignment=a.alignment)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
