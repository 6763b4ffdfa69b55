"""ggml block types and the array that carries one quantized weight matrix.

A weight ``[rows, cols]`` (the checkpoint's ``[out, in]`` layout) is stored row by row: each row is
``cols // block_elems`` blocks of ``block_bytes`` bytes, byte for byte as ggml defines them, so a
GGUF file's tensor data is used as it is (``QuantArray.data`` may be a view of a memory-mapped file).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class BlockType:
    name: str          # moescope's name, as in model.expert_format
    ggml_id: int       # ggml_type / GGMLQuantizationType value
    block_elems: int   # weights per block
    block_bytes: int   # bytes per block

    def row_bytes(self, cols: int) -> int:
        if cols % self.block_elems:
            raise ValueError(f"{self.name}: a row of {cols} is not a whole number of {self.block_elems}-weight blocks")
        return cols // self.block_elems * self.block_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_elems


# ggml's layouts (ggml-common.h): Q8_0 = f16 d + 32 int8; Q4_0 = f16 d + 16 bytes of nibbles;
# Q4_K = f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles (256 weights);
# Q6_K = 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, f16 d (256 weights).
BLOCK_TYPES: dict[str, BlockType] = {
    "f32": BlockType("f32", 0, 1, 4),
    "f16": BlockType("f16", 1, 1, 2),
    "q4_0": BlockType("q4_0", 2, 32, 18),
    "q8_0": BlockType("q8_0", 8, 32, 34),
    "q4_k": BlockType("q4_k", 12, 256, 144),
    "q6_k": BlockType("q6_k", 14, 256, 210),
    "bf16": BlockType("bf16", 30, 1, 2),
}
BY_GGML_ID: dict[int, BlockType] = {t.ggml_id: t for t in BLOCK_TYPES.values()}
QUANTIZED = ("q8_0", "q4_0", "q4_k", "q6_k")


def block_type(name: str) -> BlockType:
    try:
        return BLOCK_TYPES[name]
    except KeyError:
        raise ValueError(f"unsupported block type {name!r}; supported: {', '.join(BLOCK_TYPES)}") from None


@dataclasses.dataclass(frozen=True)
class QuantArray:
    """One quantized matrix: ``data`` uint8 ``[rows, row_bytes]`` holding ``shape = (rows, cols)`` weights."""
    data: Any            # np.ndarray (host, possibly a memmap view) or jax.Array (device), dtype uint8
    qtype: str           # a key of BLOCK_TYPES
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        t = block_type(self.qtype)
        rows, cols = self.shape
        want = (rows, t.row_bytes(cols))
        if tuple(self.data.shape) != want or np.dtype(self.data.dtype) != np.uint8:
            raise ValueError(f"{self.qtype} matrix {self.shape}: data must be uint8 {want}, "
                             f"got {np.dtype(self.data.dtype)} {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return int(self.data.shape[0]) * int(self.data.shape[1])
