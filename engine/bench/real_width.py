"""Random-weight HF checkpoints at the real hidden and expert widths of shipped model configs.

A real-width checkpoint keeps every matrix of one decoder layer at the size of the released model
(Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V2-Lite, ...) and only cuts the depth, so that memory traffic,
kernel shapes and expert sizes per layer are those of the real model while the whole folder fits a
small machine. Weights are random bf16 (std 0.02, norms 1), written as a sharded safetensors checkpoint
with `model.safetensors.index.json` in either the per-expert layout `save_pretrained` writes or the fused
transformers-v5 layout, so transformers, llama.cpp converters and moescope's loader can all read it.

    from engine.bench.real_width import real_width_config, write_random_checkpoint
    cfg = real_width_config("qwen3_moe", num_layers=4)
    write_random_checkpoint(cfg, "runs/real_width/qwen3", layout="fused")

Tensor names and shapes come from `models.hf.tensor_sources` (only the `pieces` of each source).
Values are cheap to make: one pool of normal bf16 bit patterns is sampled per call and every block
of a tensor is a pool slice whose sign and low mantissa bits are XOR-ed with another slice, at
offsets drawn from a generator seeded by the tensor's name. No two tensors (or experts) share bytes,
and the per-expert and fused layouts written with the same seed hold the same model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from models.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "models" / "checkpoints" / "mixtral-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
COMPLETE_MARKER = ".real_width_complete.json"  # written last by `cached_checkpoint`
LAYOUTS = ("per_expert", "fused")

_STD = 0.02
_POOL = 1 << 24  # bf16 values in the shared random pool (32 MiB)
_BLOCK = 1 << 20  # values per independently-offset block of a tensor
_ONE_BF16 = 0x3F80


@dataclass(frozen=True)
class Preset:
    """A family at real width: the shipped config (`conf/model/<model>.yaml`) and the default depth."""

    model: str
    num_layers: int
    note: str = ""  # what the preset stands for (read by people: the table names the family)
    changes: tuple[tuple[str, Any], ...] = ()  # other fields replaced (e.g. fewer experts per layer)


PRESETS: dict[str, Preset] = {
    "mixtral": Preset("mixtral_8x7b", 2, "Mixtral-8x7B width: 8 experts of 4096x14336 (336 MiB each)"),
    "qwen3_moe": Preset("qwen3_30b_a3b", 4, "Qwen3-30B-A3B width: 128 experts of 2048x768, top-8"),
    "deepseek_v2": Preset("deepseek_v2_lite", 5, "DeepSeek-V2-Lite width: MLA, 1 dense layer + MoE layers of "
                                                 "64 experts of 2048x1408 + 2 shared"),
    # all 27 layers of DeepSeek-V2-Lite with 8 of its 64 experts per layer (still top-6): the depth llama.cpp
    # needs to recognise a DeepSeek-V2 without q-LoRA (it tells Lite from V2 by n_layer == 27)
    "deepseek_v2_27": Preset("deepseek_v2_lite", 27, "DeepSeek-V2-Lite width and depth, 8 experts per layer",
                             (("num_experts", 8),)),
    # one Mixtral-width layer with 4 of its 8 experts (still top-2): a b1 step reads what Mixtral's does, and its GGUF
    # files (bf16 2.0 GB, Q8_0 1.1 GB, Q4_K_M 0.65 GB) are compared on a machine shared by several jobs
    "mixtral_e4": Preset("mixtral_8x7b", 1, "Mixtral-8x7B width, 1 layer of 4 experts of 4096x14336, top-2",
                         (("num_experts", 4),)),
    "phimoe": Preset("phi35_moe", 2, "Phi-3.5-MoE width: 16 experts of 4096x6400, LayerNorm, biases"),
}


def base_config(model: str) -> ModelConfig:
    """The frozen `ModelConfig` of `conf/model/<model>.yaml` (its `arch`)."""
    from core.config import to_frozen
    from conf import compose

    arch = compose("generate", [f"model={model}"]).model.arch
    if arch is None:
        raise ValueError(f"conf/model/{model}.yaml has no arch")
    return to_frozen(arch, ModelConfig)


def real_width_config(family: str, num_layers: Optional[int] = None, **changes) -> ModelConfig:
    """The preset of `family` cut to `num_layers` decoder layers (its default depth when None).

    Hidden, attention and expert widths stay those of the released model; `changes` overrides any
    other field (e.g. `num_experts=8, vocab_size=8192` for a small test variant). DeepSeek keeps its
    `first_k_dense_replace` dense layers in front, so the truncated model still has a dense layer
    followed by MoE layers; at least one MoE layer is required."""
    if family not in PRESETS:
        raise KeyError(f"no real-width preset {family!r}; known: {sorted(PRESETS)}")
    preset = PRESETS[family]
    cfg = base_config(preset.model)
    layers = num_layers if num_layers is not None else preset.num_layers
    changes = {**dict(preset.changes), **changes}
    fields = {"num_hidden_layers": int(layers), **changes}
    if "num_experts" in changes and "num_experts_per_tok" not in changes:
        fields["num_experts_per_tok"] = min(cfg.num_experts_per_tok, int(changes["num_experts"]))
    if "num_experts" in changes and cfg.n_group > 1 and "n_group" not in changes:
        fields.update(n_group=1, topk_group=1)
    out = dataclasses.replace(cfg, **fields)
    if not out.moe_layers:
        raise ValueError(f"{family} with {layers} layers has no MoE layer "
                         f"(first_k_dense_replace={out.first_k_dense_replace})")
    return out


# ---- what to write ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the checkpoint: HF name, full shape, how to fill it, and the content keys of
    its leading-axis blocks (each block = these keys' contents stacked along axis 0)."""

    name: str
    shape: tuple[int, ...]
    fill: str  # "random" | "ones" | "zeros"
    blocks: tuple[tuple[tuple[str, int], ...], ...]  # per block along axis 0 (one block unless fused): (key, rows)

    @property
    def nbytes(self) -> int:
        return 2 * math.prod(self.shape)


def _fill_of(name: str) -> str:
    parts = name.split(".")
    module, leaf = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    if leaf == "e_score_correction_bias":
        return "zeros"
    if "norm" in module:
        return "ones" if leaf == "weight" else "zeros"
    return "random"


def tensor_specs(cfg: ModelConfig, layout: str = "per_expert") -> list[TensorSpec]:
    """Every tensor of `cfg`'s checkpoint in `layout`, in `tensor_sources` order, each fused tensor once.

    Content keys are the per-expert layout's names, so both layouts of one seed hold the same model:
    the fused `[E, ...]` tensor's slice e is the per-expert pieces of expert e stacked along their
    first axis (gate over up, as transformers' `gate_up_proj`)."""
    from models.hf import tensor_sources

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    legacy = tensor_sources(cfg, fused=False)
    sources = legacy if layout == "per_expert" else tensor_sources(cfg, fused=True)
    # content keys of the fused slices: the legacy pieces at the same position, where the two lists agree
    keys: dict[tuple[str, Optional[int]], tuple[tuple[str, int], ...]] = {}
    aligned = len(legacy) == len(sources)
    for src, ref in zip(sources, legacy if aligned else sources):
        ours, theirs = src.pieces, ref.pieces
        if len(ours) == 1 and ours[0].index is not None and all(p.index is None for p in theirs) \
                and sum(p.shape[0] for p in theirs) == ours[0].shape[1] \
                and all(tuple(p.shape[1:]) == tuple(ours[0].shape[2:]) for p in theirs):
            keys[(ours[0].name, ours[0].index)] = tuple((p.name, p.shape[0]) for p in theirs)
        elif len(ours) == len(theirs) and all(a.index is None and tuple(a.shape) == tuple(b.shape)
                                              for a, b in zip(ours, theirs)):
            for a, b in zip(ours, theirs):
                keys[(a.name, None)] = ((b.name, a.shape[0] if a.shape else 1),)
    shape_of: dict[str, tuple[int, ...]] = {}  # every tensor once, in order of first appearance
    blocks_of: dict[str, dict[int, tuple[tuple[str, int], ...]]] = {}  # slice index (-1: whole tensor) -> keys
    for src in sources:
        for p in src.pieces:
            shape = tuple(int(s) for s in p.shape)
            if p.name not in shape_of:
                shape_of[p.name], blocks_of[p.name] = shape, {}
            if p.index is None:
                blocks_of[p.name][-1] = keys.get((p.name, None), ((p.name, shape[0] if shape else 1),))
            else:
                blocks_of[p.name][int(p.index)] = keys.get((p.name, p.index), ((f"{p.name}#{p.index}", shape[1]),))
    out: list[TensorSpec] = []
    for name, shape in shape_of.items():
        parts = blocks_of[name]
        if -1 in parts:
            blocks = (parts[-1],)
        else:
            missing = sorted(set(range(shape[0])) - set(parts))
            if missing:
                raise ValueError(f"{name}: no piece for slices {missing[:8]} of its {shape[0]}")
            blocks = tuple(parts[e] for e in range(shape[0]))
        out.append(TensorSpec(name, shape, _fill_of(name), blocks))
    return out


# ---- values -------------------------------------------------------------------------------------------


class _Values:
    """Distinct plausible bf16 bit patterns (uint16) for any content key, cheaply."""

    def __init__(self, seed: int):
        self.seed = seed
        rng = np.random.default_rng(seed)
        f = rng.standard_normal(_POOL + _BLOCK, dtype=np.float32) * np.float32(_STD)
        bits = f.view(np.uint32)
        # round to nearest even into bf16
        self.pool = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)

    def fill(self, key: str, out: np.ndarray) -> None:
        """Write the values of `key` into the flat uint16 array `out`."""
        n = out.size
        rng = np.random.default_rng([self.seed, zlib.crc32(key.encode()), n])
        nblk = -(-n // _BLOCK)
        offs = rng.integers(0, _POOL, size=(nblk, 2))
        for j in range(nblk):
            lo, hi = j * _BLOCK, min(n, (j + 1) * _BLOCK)
            a, b = offs[j]
            seg = out[lo:hi]
            np.bitwise_and(self.pool[b:b + hi - lo], 0x800F, out=seg)
            np.bitwise_xor(seg, self.pool[a:a + hi - lo], out=seg)


def _tensor_bits(spec: TensorSpec, values: _Values) -> np.ndarray:
    n = math.prod(spec.shape)
    if spec.fill == "ones":
        return np.full(spec.shape, _ONE_BF16, np.uint16)
    if spec.fill == "zeros":
        return np.zeros(spec.shape, np.uint16)
    out = np.empty(n, np.uint16)
    per_block = n // len(spec.blocks)  # a fused tensor: one block per expert; otherwise the whole tensor
    pos = 0
    for block in spec.blocks:
        rows_in_block = sum(r for _, r in block)
        for key, rows in block:  # the block's parts (e.g. gate then up) stacked along its first axis
            size = per_block * rows // rows_in_block
            values.fill(key, out[pos:pos + size])
            pos += size
    if pos != n:
        raise AssertionError(f"{spec.name}: filled {pos} of {n} values")
    return out.reshape(spec.shape)


# ---- writing ------------------------------------------------------------------------------------------


def shard_plan(specs: list[TensorSpec], shards: int) -> list[list[TensorSpec]]:
    """`specs` cut, in order, into `shards` runs of about equal bytes (fewer if there are fewer tensors)."""
    shards = max(1, min(int(shards), len(specs)))
    total = sum(s.nbytes for s in specs)
    out: list[list[TensorSpec]] = [[]]
    done = 0
    for s in specs:
        if out[-1] and len(out) < shards and done + s.nbytes / 2 > total * len(out) / shards:
            out.append([])
        out[-1].append(s)
        done += s.nbytes
    return out


def hf_config_dict(cfg: ModelConfig) -> dict:
    from models.hf import config_to_hf

    d = config_to_hf(cfg)
    d["torch_dtype"] = "bfloat16"
    d["dtype"] = "bfloat16"
    return d


def write_random_checkpoint(cfg: ModelConfig, folder: str | Path, *, layout: str = "per_expert", shards: int = 3,
                            seed: int = 0, tokenizer: bool = True, verbose: bool = False) -> Path:
    """Write a random bf16 checkpoint of `cfg` into `folder` (config.json, `shards` safetensors files,
    model.safetensors.index.json, and the shipped tokenizer files when `tokenizer`); returns the folder.

    Memory stays about twice the largest shard (the shard being written and the next one being made)."""
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(cfg, layout)
    plan = shard_plan(specs, shards)
    values = _Values(seed)
    weight_map: dict[str, str] = {}
    total = sum(s.nbytes for s in specs)
    t0 = time.perf_counter()
    names = [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]

    def make(group: list[TensorSpec]) -> dict:
        return {s.name: torch.from_numpy(_tensor_bits(s, values).view(np.int16)).view(torch.bfloat16) for s in group}

    # shard k+1's values are made while shard k is written (safetensors writes without the GIL)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(make, plan[0])
        for k, group in enumerate(plan):
            tensors = pending.result()
            if k + 1 < len(plan):
                pending = pool.submit(make, plan[k + 1])
            tmp = folder / (names[k] + ".tmp")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            del tensors
            tmp.replace(folder / names[k])
            weight_map.update({s.name: names[k] for s in group})
            if verbose:
                done = sum(s.nbytes for g in plan[:k + 1] for s in g)
                dt = time.perf_counter() - t0
                print(f"  {names[k]}: {done / 1e9:.2f}/{total / 1e9:.2f} GB, {done / 1e9 / max(dt, 1e-9):.2f} GB/s",
                      flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2) + "\n")
    if tokenizer:
        for name in TOKENIZER_FILES:
            if (TOKENIZER_DIR / name).is_file():
                shutil.copyfile(TOKENIZER_DIR / name, folder / name)
    return folder


def checkpoint_bytes(folder: str | Path) -> int:
    """Bytes of the checkpoint's safetensors files."""
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def cached_checkpoint(name: str, cfg: ModelConfig, root: str | Path, *, layout: str = "per_expert",
                      shards: Optional[int] = None, seed: int = 0, tokenizer: bool = True,
                      verbose: bool = False) -> Path:
    """`root/name`, written by `write_random_checkpoint` unless a complete folder for the same config,
    layout and seed is already there (a marker file written last says so). An incomplete or different
    folder is rebuilt. `shards` None: about one shard per 2 GB (at least 3)."""
    folder = Path(root) / name
    want = {"config": hf_config_dict(cfg), "layout": layout, "seed": seed}
    marker = folder / COMPLETE_MARKER
    if marker.is_file():
        try:
            have = json.loads(marker.read_text())
        except json.JSONDecodeError:
            have = {}
        if all(have.get(k) == v for k, v in want.items()):
            return folder
    if folder.exists():
        shutil.rmtree(folder)
    if shards is None:
        shards = max(3, math.ceil(sum(s.nbytes for s in tensor_specs(cfg, layout)) / 2e9))
    t = time.perf_counter()
    write_random_checkpoint(cfg, folder, layout=layout, shards=shards, seed=seed, tokenizer=tokenizer, verbose=verbose)
    seconds = time.perf_counter() - t
    size = checkpoint_bytes(folder)
    marker.write_text(json.dumps({**want, "bytes": size, "write_s": seconds}, indent=2) + "\n")
    return folder


def write_speed(folder: str | Path) -> Optional[float]:
    """GB/s that `cached_checkpoint` recorded when it wrote `folder` (None if unknown)."""
    try:
        d = json.loads((Path(folder) / COMPLETE_MARKER).read_text())
        return d["bytes"] / 1e9 / d["write_s"]
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None


def describe(cfg: ModelConfig) -> str:
    moe = len(cfg.moe_layers)
    return (f"{cfg.family.value}: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers ({moe} MoE), "
            f"{cfg.num_experts} experts x {cfg.hidden_size}x{cfg.expert_intermediate_size} "
            f"({cfg.expert_bytes() / 2**20:.1f} MiB bf16), top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}")


def _main(argv: Optional[Iterable[str]] = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="write a random real-width bf16 checkpoint")
    ap.add_argument("family", choices=sorted(PRESETS))
    ap.add_argument("folder")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--layout", choices=LAYOUTS, default="per_expert")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    cfg = real_width_config(a.family, a.layers)
    print(describe(cfg))
    t = time.perf_counter()
    write_random_checkpoint(cfg, a.folder, layout=a.layout, shards=a.shards, seed=a.seed, verbose=True)
    dt = time.perf_counter() - t
    size = checkpoint_bytes(a.folder)
    print(f"wrote {a.folder}: {size / 1e9:.2f} GB in {dt:.1f} s ({size / 1e9 / dt:.2f} GB/s)")


if __name__ == "__main__":
    _main()

