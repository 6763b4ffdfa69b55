"""HF FP8 checkpoints (block-scaled e4m3, as DeepSeek-V3/R1, Moonlight-FP8 and Qwen3-*-FP8 ship) as moescope
checkpoints.

Such a folder's config.json carries `quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], ...}`; each quantized linear `X.weight` is float8_e4m3fn [out, in] with
`X.weight_scale_inv` float32 [ceil(out / 128), ceil(in / 128)], and the weight is `fp8 * scale_inv` block by
block (the name notwithstanding, `scale_inv` multiplies: it is the inverse of the quantizer's scale). Norms,
embeddings and routers stay bf16.

    ck = open_fp8(folder)        # headers checked: every FP8 weight has its scale, of the block grid's shape
    load_hf(folder, opened=ck)   # every FP8 weight dequantized (exactly, in float32) then cast to the run dtype

`FP8Tensors` presents the folder through the `CheckpointReader` interface with the scales folded in, so the
in-memory loader, the offload expert store and quantize-on-load (which requantizes the dequantized experts to a
named block format) read it as a float checkpoint. The dequantization is exact in float32 (an e4m3 value times
an f32 scale is one f32 rounding); run in bfloat16 it rounds once more, as DeepSeek's own fp8-to-bf16 cast does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import ml_dtypes
import numpy as np

from models.hf import (CheckpointError, CheckpointReader, OpenCheckpoint, Piece, detect_fused, read_config,
                       tensor_sources, validate_checkpoint)

FP8_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
SCALE_SUFFIX = "_scale_inv"


def quantization_config(folder: str | Path) -> Optional[dict[str, Any]]:
    """config.json's `quantization_config`, or None."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("quantization_config")
    except (json.JSONDecodeError, AttributeError):
        return None


def is_fp8_checkpoint(folder: str | Path) -> bool:
    q = quantization_config(folder)
    return isinstance(q, dict) and q.get("quant_method") == "fp8"


def block_size(folder: Path) -> tuple[int, int]:
    """`weight_block_size` [rows, cols] of an FP8 checkpoint; per-tensor scaling is not what these files ship."""
    q = quantization_config(folder) or {}
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{folder / 'config.json'}: quantization_config.fmt = {q.get('fmt')!r}; moescope reads "
                              "e4m3 FP8 checkpoints")
    size = q.get("weight_block_size")
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
        raise CheckpointError(f"{folder / 'config.json'}: quantization_config.weight_block_size = {size!r}; "
                              "expected two positive integers (block-scaled FP8, e.g. [128, 128])")
    return int(size[0]), int(size[1])


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 [out, in] = e4m3 `weight` [out, in] times its block's `scale_inv` [ceil(out/bo), ceil(in/bi)]."""
    bo, bi = block
    out, inp = weight.shape
    scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, axis=0)[:out], bi, axis=1)[:, :inp]
    return np.asarray(weight).astype(np.float32) * scale


class FP8Tensors:
    """An FP8 checkpoint's tensors with the scales folded in: the `CheckpointReader` interface, FP8 weights read as
    float32 (dequantized), their `*_scale_inv` tensors hidden."""

    def __init__(self, folder: str | Path):
        self.inner = CheckpointReader(folder)
        self.folder = self.inner.folder
        self.file_bytes = self.inner.file_bytes
        self.block = block_size(self.folder)
        self._fp8 = {n for n in self.inner.keys() if self.inner._entries[n].dtype in FP8_DTYPES}
        for name in sorted(self._fp8):
            self._check_scale(name)

    def _check_scale(self, name: str) -> None:
        scale = name + SCALE_SUFFIX
        where = f"{self.folder}"
        if scale not in self.inner.keys():
            raise CheckpointError(f"{where}: FP8 tensor {name} has no {scale} (block-scaled FP8 needs one)")
        shape = self.inner.shape(name)
        want = tuple(math.ceil(d / b) for d, b in zip(shape, self.block))
        if len(shape) != 2 or self.inner.shape(scale) != want:
            raise CheckpointError(f"{where}: {scale} has shape {list(self.inner.shape(scale))}, but {name} "
                                  f"{list(shape)} in {list(self.block)} blocks needs {list(want)}")

    def keys(self) -> list[str]:
        return [n for n in self.inner.keys() if not (n.endswith(SCALE_SUFFIX) and n[:-len(SCALE_SUFFIX)] in self._fp8)]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(np.float32) if name in self._fp8 else self.inner.dtype(name)

    @property
    def run_dtype(self) -> np.dtype:
        """What `dtype=auto` runs the checkpoint in: the dtype of its unquantized tensors (bf16 as released)."""
        plain = [self.inner.dtype(n) for n in self.keys() if n not in self._fp8 and "embed" in n]
        return plain[0] if plain else np.dtype(ml_dtypes.bfloat16)

    def is_fp8(self, name: str) -> bool:
        return name in self._fp8

    def view(self, piece: Piece) -> np.ndarray:
        if piece.name not in self._fp8:
            return self.inner.view(piece)
        entry = self.inner._entries[piece.name]
        raw = self.inner._map(entry.file)[entry.start:entry.end].view(FP8_DTYPES[entry.dtype]).reshape(entry.shape)
        scale = self.inner.view(Piece(piece.name + SCALE_SUFFIX, self.inner.shape(piece.name + SCALE_SUFFIX)))
        out = dequantize(raw, scale, self.block)
        return out if piece.index is None else out[piece.index]


def open_fp8(folder: str | Path) -> OpenCheckpoint:
    """An FP8 checkpoint folder opened and checked (config, headers, every weight's scale grid): nothing read yet."""
    folder = Path(folder)
    cfg = read_config(folder)
    reader = FP8Tensors(folder)
    fused = detect_fused(reader.keys())
    if fused and any(reader.is_fp8(n) for n in reader.keys() if n.endswith(("gate_up_proj", "down_proj"))):
        raise CheckpointError(f"{folder}: FP8 experts in the fused [E, ...] layout are not read (per-expert tensors, "
                              "as DeepSeek-V3 and Qwen3-FP8 ship, are)")
    sources = tensor_sources(cfg, fused=fused)
    validate_checkpoint(reader, sources, cfg)  # type: ignore[arg-type]
    return OpenCheckpoint(folder, cfg, reader, sources, fused)  # type: ignore[arg-type]
