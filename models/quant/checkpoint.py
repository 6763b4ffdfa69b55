"""A quantized checkpoint folder: saved once, then only memory-mapped.

Layout (an HF folder plus one file):

* `config.json`: the HF config, plus `"moescope_quantized": {"expert_format": ..., "experts_file": ...}`;
* `model.safetensors`: every non-expert tensor under its HF name, in the dtype it was saved in (bf16);
* `experts.safetensors`: per routed expert two `U8` tensors, `<layer prefix>.experts.<e>.gate_up` [2F, row bytes]
  (gate rows then up rows) and `.down` [H, row bytes], ggml's blocks byte for byte; the header's
  `__metadata__` maps each tensor name to its block type (`gguf`-style names: q4_k, q6_k, ...). Tensors are
  written from a 64-byte-aligned data start, so the views of the mapped file that the model and the host
  store use are aligned (JAX aliases them on the CPU backend instead of copying);
* the source folder's tokenizer files, copied.

`model.checkpoint=<folder>` loads it: dense tensors through the ordinary reader, experts as views of the
mapped `experts.safetensors` (nothing copied, nothing re-quantized).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

import ml_dtypes
import numpy as np

from models.config import ModelConfig
from models.quant.blocks import BLOCK_TYPES, QuantArray

MARKER = "moescope_quantized"
EXPERTS_FILE = "experts.safetensors"
ALIGN = 64
_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float16): "F16",
              np.dtype(np.uint8): "U8"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def quantized_info(folder: Optional[Path]) -> Optional[dict[str, Any]]:
    """The `moescope_quantized` entry of a folder's config.json, or None for any other folder."""
    if folder is None or not (Path(folder) / "config.json").is_file():
        return None
    try:
        info = json.loads((Path(folder) / "config.json").read_text()).get(MARKER)
    except (json.JSONDecodeError, AttributeError):
        return None
    return info if isinstance(info, dict) else None


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: Optional[dict[str, str]] = None) -> None:
    """A safetensors file (readable by the `safetensors` library) whose data starts 64-byte aligned; tensors in
    the given order, back to back (each one's start aligned when the earlier ones' sizes are multiples of 64)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, arr in tensors.items():
        if np.dtype(arr.dtype) not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {arr.dtype}, not one safetensors stores here")
        header[name] = {"dtype": _ST_DTYPES[np.dtype(arr.dtype)], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data)
    tmp.replace(path)


def expert_prefix(cfg: ModelConfig, layer: int) -> str:
    """`model.layers.<i>.<moe module>` of an HF checkpoint's per-expert names (the routed experts' parent)."""
    from models.hf import expert_pieces

    gate_up, _ = expert_pieces(cfg, layer, 0, fused=False)
    return gate_up[0].name.split(".experts.")[0]


def save_quantized(model: Any, folder: str | Path, expert_format: str, source: Optional[Path] = None) -> Path:
    """Write `model` (its experts quantized: `QuantExperts` in every MoE layer) as a quantized folder (module doc).
    `source`: a checkpoint folder whose tokenizer files are copied."""
    import jax
    from flax import nnx

    from models.hf import config_to_hf, tensor_sources
    from models.quant.experts import QuantExperts

    cfg: ModelConfig = model.cfg
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    dense: dict[str, np.ndarray] = {}
    for src in tensor_sources(cfg, fused=False):
        if src.expert is not None:
            continue
        node: Any = pure
        for key in src.path:
            node = node[key]
        arr = np.asarray(jax.device_get(node))
        rows = np.cumsum([p.rows for p in src.pieces])[:-1]
        for piece, chunk in zip(src.pieces, np.split(arr, rows, axis=0) if len(src.pieces) > 1 else [arr]):
            dense[piece.name] = np.ascontiguousarray(chunk)
    blocks: dict[str, np.ndarray] = {}
    qtypes: dict[str, str] = {}
    for layer in cfg.moe_layers:
        experts = model.layers[layer].moe.experts
        if not isinstance(experts, QuantExperts):
            raise ValueError(f"save_quantized: layer {layer}'s experts are not quantized (load with model.expert_format)")
        prefix = expert_prefix(cfg, layer)
        for e, ((gate, up), dn) in enumerate(zip(*experts.arrays())):
            for part, data, qtype in (("gate_up", np.concatenate([np.asarray(jax.device_get(gate.data)),
                                                                  np.asarray(jax.device_get(up.data))]), gate.qtype),
                                      ("down", np.asarray(jax.device_get(dn.data)), dn.qtype)):
                name = f"{prefix}.experts.{e}.{part}"
                blocks[name], qtypes[name] = data, qtype
    write_safetensors(folder / EXPERTS_FILE, blocks, {"moescope.qtypes": json.dumps(qtypes)})
    write_safetensors(folder / "model.safetensors", dense, {"format": "pt"})
    hf = config_to_hf(cfg)
    hf["dtype"] = {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float16): "float16"}.get(
        np.dtype(model.run_dtype), "float32")
    hf[MARKER] = {"expert_format": expert_format, "experts_file": EXPERTS_FILE}
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if source is not None and (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, folder / name)
    return folder


def open_dense(folder: Path) -> Any:
    """The folder's non-expert tensors as an `OpenCheckpoint` (headers read and checked, nothing mapped yet)."""
    from models.hf import CheckpointReader, OpenCheckpoint, read_config, tensor_sources, validate_checkpoint

    cfg = read_config(folder)
    reader = CheckpointReader(folder)
    sources = [s for s in tensor_sources(cfg, fused=False) if s.expert is None]
    validate_checkpoint(reader, sources, cfg)
    return OpenCheckpoint(Path(folder), cfg, reader, sources, False)


def mapped_experts(folder: Path, cfg: ModelConfig) -> dict[int, tuple[list[QuantArray], list[QuantArray]]]:
    """Decoder layer -> (gate|up, down) `QuantArray`s whose data are views of the mapped experts file."""
    from models.hf import CheckpointError, read_safetensors_header

    path = Path(folder) / (quantized_info(folder) or {}).get("experts_file", EXPERTS_FILE)
    if not path.is_file():
        raise CheckpointError(f"{path}: the quantized checkpoint's experts file is missing")
    entries, _ = read_safetensors_header(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n)).get("__metadata__", {})
    qtypes = json.loads(meta.get("moescope.qtypes", "{}"))
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    H, F = cfg.hidden_size, cfg.expert_intermediate_size
    out = {}
    for layer in cfg.moe_layers:
        prefix = expert_prefix(cfg, layer)
        lists: tuple[list, list] = ([], [])
        for e in range(cfg.num_experts):
            for i, (part, shape) in enumerate((("gate_up", (2 * F, H)), ("down", (H, F)))):
                name = f"{prefix}.experts.{e}.{part}"
                entry, qtype = entries.get(name), qtypes.get(name)
                if entry is None or qtype not in BLOCK_TYPES or entry.dtype != "U8":
                    raise CheckpointError(f"{path}: tensor {name} is missing or not a U8 block tensor with a known "
                                          f"block type (metadata says {qtype!r}; supported: {', '.join(BLOCK_TYPES)})")
                data = mapped[entry.start:entry.end].reshape(entry.shape)
                try:
                    lists[i].append(QuantArray(data, qtype, shape))
                except ValueError as exc:
                    raise CheckpointError(f"{path}: tensor {name}: {exc}") from None
        out[layer] = lists
    return out
