"""Dense projections kept in their ggml blocks (`model.dense_format=blocks`, a GGUF file's default).

A GGUF file stores the attention projections and the LM head in block types too (llama.cpp's Q4_K_M: Q4_K q/k/o,
Q6_K v in some layers, Q6_K output). Dequantizing them to bf16 on load makes every token read ~2-3.6x their stored
bytes; `QuantLinear` instead multiplies by the blocks through the native block kernel (`models.native.qlinear`: the
activations rounded as llama.cpp rounds them -- Q8_0 per 32 for Q8_0 / Q4_0 weights, Q8_K per 256 for the K-quants
-- integer dot products, f32 sums rounded once to the activation dtype), so a token reads what llama.cpp reads.
The dense SwiGLU MLPs (a dense layer's, DeepSeek's shared experts) are kept the same way (`QuantSwiGLU`), and the
token embedding as `EmbedBlocks`, whose lookup dequantizes only the rows it reads (`embed_lookup`): with them a
GGUF model's anonymous memory is its norms, routers and MLA's kv_b, not a bf16 copy of the file's dense bytes.

The block bytes of each row part are held as uint8 [rows, blocks, block_bytes]: the block size names the type
(Q4_0 18, Q8_0 34, Q4_K 144, Q6_K 210 bytes), so the type is recovered from the array's shape at trace time and
every layer of a model shares one module structure (the offload executor compiles one attention for all
layers) even where llama.cpp's presets give some layers other types.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import native
from models.native import take_rows
from models.quant.blocks import BLOCK_TYPES, QuantArray

_BY_BLOCK_BYTES = {t.block_bytes: t for name, t in BLOCK_TYPES.items() if name in native.QTYPE_IDS}
ATTENTION_LINEARS = ("qkv", "o", "q", "q_a", "q_b", "kv_a")
"""Attention projections (`Linear` attributes of GQA and MLA attention) that may be kept in blocks; MLA's kv_b is
not (its weight is absorbed into the attention, read as a matrix)."""
SWIGLU_PARTS = ("gate_up", "down")
SWIGLU_MODULES = (("mlp",), ("moe", "shared"))
"""Dense SwiGLU MLPs (`models.layers.SwiGLU`) that may be kept in blocks, by their path inside a decoder layer: a
dense layer's MLP and DeepSeek's shared experts (DeepSeek-V2-Lite Q8_0: 0.55 GB of blocks, 1.03 GB in bf16)."""


class DenseBlocks(nnx.Variable):
    """uint8 [rows, blocks, block_bytes] of one dense matrix (or one row part of it) in ggml blocks."""


def blocks3(q: QuantArray) -> Any:
    """`q`'s bytes as [rows, blocks, block_bytes] (a view: numpy or jax)."""
    t = BLOCK_TYPES[q.qtype]
    return q.data.reshape(q.shape[0], q.shape[1] // t.block_elems, t.block_bytes)


def cols_of(blocks: Any) -> int:
    """Weights per row of block bytes [rows, blocks, block_bytes]."""
    return int(blocks.shape[1]) * _BY_BLOCK_BYTES[int(blocks.shape[2])].block_elems


def as_quant(blocks: Any) -> QuantArray:
    """The `QuantArray` [rows, cols] of block bytes [rows, blocks, block_bytes] (type from the block size)."""
    rows, nb, bb = blocks.shape
    t = _BY_BLOCK_BYTES[int(bb)]
    return QuantArray(blocks.reshape(rows, nb * bb), t.name, (int(rows), int(nb) * t.block_elems))


class QuantLinear(nnx.Module):
    """y = x W^T (+ bias) for W [N, K] kept in ggml blocks as row parts W = [W_0; W_1; ...] (e.g. q, k, v, each
    in its own type): y = [x W_0^T, x W_1^T, ...] in x's dtype. Stands where `models.layers.Linear` stands."""

    def __init__(self, parts: Sequence[Any], bias: Optional[nnx.Param] = None):
        """`parts`: `QuantArray`s, or their bytes as [rows, blocks, block_bytes] arrays (`blocks3`)."""
        qs = [q if isinstance(q, QuantArray) else None for q in parts]
        if any(q is not None and q.qtype not in native.QTYPE_IDS for q in qs):
            raise ValueError(f"QuantLinear: block types {[q.qtype for q in qs if q is not None]}; the native kernels "
                             f"read {', '.join(native.QTYPE_IDS)}")
        blocks = [blocks3(q) if q is not None else p for q, p in zip(qs, parts)]
        if not blocks or any(b.ndim != 3 or int(b.shape[2]) not in _BY_BLOCK_BYTES for b in blocks):
            raise ValueError(f"QuantLinear: row parts must be block arrays [rows, blocks, block_bytes], got "
                             f"{[tuple(b.shape) for b in blocks]}")
        if len({cols_of(b) for b in blocks}) != 1:
            raise ValueError(f"QuantLinear: row parts must share their columns, got {[tuple(b.shape) for b in blocks]}")
        self.parts = nnx.List([DenseBlocks(b) for b in blocks])
        self.bias = bias

    @property
    def quant_parts(self) -> list[QuantArray]:
        return [as_quant(p[...]) for p in self.parts]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(int(p[...].shape[0]) for p in self.parts), cols_of(self.parts[0][...])

    @property
    def nbytes(self) -> int:
        return sum(int(p[...].nbytes) for p in self.parts)

    def __call__(self, x: jax.Array) -> jax.Array:
        ys = [native.qlinear(x, q) for q in self.quant_parts]
        y = ys[0] if len(ys) == 1 else jnp.concatenate(ys, axis=-1)
        return (y + self.bias[...]).astype(x.dtype) if self.bias is not None else y


class EmbedBlocks(nnx.Variable):
    """uint8 [V, blocks, block_bytes]: the token embedding kept in its ggml blocks (`model.embed`; a GGUF file's
    Q4_K / Q8_0 `token_embd`): a lookup copies and dequantizes only the rows it reads."""


def embed_lookup(table: jax.Array, tokens: jax.Array, dtype: Any) -> jax.Array:
    """Embedding rows at `tokens` [...] -> [..., H] in `dtype`. A table in blocks (uint8 [V, blocks, block_bytes])
    has the looked-up rows' blocks copied, then dequantized (ggml's arithmetic in f32, then rounded to `dtype`: the
    values `dense_format=dequantize` would have stored); any other table is indexed as it is."""
    rows = take_rows(table, tokens)
    if table.dtype != jnp.uint8:
        return rows
    from models.quant.formats import dequantize_jnp

    nb, bb = int(table.shape[1]), int(table.shape[2])
    t = _BY_BLOCK_BYTES[bb]
    flat = dequantize_jnp(rows.reshape(-1, nb * bb), t.name, nb * t.block_elems)
    return flat.astype(dtype).reshape(*tokens.shape, nb * t.block_elems)


def tied_head(h: jax.Array, table: jax.Array) -> jax.Array:
    """h [..., H] times the embedding table [V, H] transposed (a tied LM head) -> [..., V] in h's dtype; a table in
    blocks goes through the native block kernel."""
    if table.dtype == jnp.uint8:
        return native.qlinear(h, as_quant(table))
    from models.layers import linear

    return linear(h, table)


class QuantSwiGLU(nnx.Module):
    """A SwiGLU MLP (gate|up [2I, H], down [H, I]) kept in blocks: gate and up as the row parts of one `QuantLinear`,
    down another. Activations float32 between the two (each product's input rounded by the native kernel as
    llama.cpp rounds it), the output in x's dtype. Stands where `models.layers.SwiGLU` stands."""

    def __init__(self, gate_up: QuantLinear, down: QuantLinear):
        self.gate_up, self.down = gate_up, down

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.gate_up(x.astype(jnp.float32))
        f = h.shape[-1] // 2
        return self.down(jax.nn.silu(h[..., :f]) * h[..., f:]).astype(x.dtype)


def _owner(model: nnx.Module, path: tuple) -> Any:
    """The module at `path` (attribute names and list indices) of `model`."""
    node: Any = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def _slots(model: nnx.Module) -> list[tuple[Any, str]]:
    """(parent module, attribute) of every projection that may be kept in blocks: attention's, the dense SwiGLU MLPs,
    the LM head."""
    out = [(layer.attn, name) for layer in model.layers for name in ATTENTION_LINEARS
           if getattr(layer.attn, name, None) is not None]
    for i, layer in enumerate(model.layers):
        for where in SWIGLU_MODULES:
            parent = _owner(model, ("layers", i) + where[:-1])
            if parent is not None and getattr(parent, where[-1], None) is not None:
                out.append((parent, where[-1]))
    return out + ([(model, "lm_head")] if model.lm_head is not None else [])


def dense_path(path: tuple) -> Optional[tuple[Any, ...]]:
    """The module path (e.g. ("layers", 3, "attn", "qkv")) of a parameter path that is a weight kept in blocks when
    its tensors are, else None; a SwiGLU's parameters keep their own paths (("layers", 0, "mlp", "gate_up"))."""
    if len(path) >= 4 and path[0] == "layers" and path[-1] in SWIGLU_PARTS and tuple(path[2:-1]) in SWIGLU_MODULES:
        return path
    if tuple(path) == ("embed",):
        return tuple(path)
    if path[-1] != "weight":
        return None
    if path[:-1] == ("lm_head",) or (len(path) == 5 and path[0] == "layers" and path[2] == "attn"
                                     and path[3] in ATTENTION_LINEARS):
        return path[:-1]
    return None


def param_path(path: tuple) -> tuple:
    """The parameter path a `dense_path` module path stands for (the loader leaves it abstract)."""
    return path if path[-1] in SWIGLU_PARTS or tuple(path) == ("embed",) else path + ("weight",)


def dense_kind(path: tuple) -> tuple:
    """What must be kept in blocks in every layer or in none (one module structure for all layers): the projection
    (("attn", "qkv")), a SwiGLU as a whole (("mlp",)), the LM head."""
    if path[0] != "layers":
        return tuple(path)
    return tuple(path[2:-1]) if path[-1] in SWIGLU_PARTS else tuple(path[2:])


def install_dense(model: nnx.Module, dense: dict[tuple, Sequence[QuantArray]]) -> None:
    """Replace the `Linear` at each module path of `dense` (see `dense_path`) by a `QuantLinear` over its row parts
    (host arrays go to the device: aliased, not copied, on the CPU backend); a bias stays the loaded one. A SwiGLU's
    two parameter paths become one `QuantSwiGLU`, the embedding an `EmbedBlocks`."""
    swiglus: dict[tuple, dict[str, QuantLinear]] = {}
    for path, parts in dense.items():
        placed = jax.device_put([blocks3(QuantArray(np.asarray(q.data), q.qtype, q.shape)) for q in parts],
                                may_alias=True)
        if path[-1] in SWIGLU_PARTS:
            swiglus.setdefault(path[:-1], {})[path[-1]] = QuantLinear(placed)
            continue
        if tuple(path) == ("embed",):
            model.embed = EmbedBlocks(placed[0])
            continue
        parent = _owner(model, path[:-1])
        setattr(parent, path[-1], QuantLinear(placed, getattr(parent, path[-1]).bias))
    for path, pair in swiglus.items():
        if set(pair) != set(SWIGLU_PARTS):
            raise ValueError(f"install_dense: {'.'.join(map(str, path))} has {sorted(pair)} in blocks, not both parts")
        setattr(_owner(model, path[:-1]), path[-1], QuantSwiGLU(pair["gate_up"], pair["down"]))


def dense_blocks_of(model: nnx.Module) -> list[tuple[Any, str]]:
    """(parent, attribute) of each `QuantLinear` or `QuantSwiGLU` in `model`."""
    return [(p, a) for p, a in _slots(model) if isinstance(getattr(p, a), (QuantLinear, QuantSwiGLU))]


def carry_dense(source: nnx.Module, target: nnx.Module, dtype: Any) -> None:
    """Give the (abstract) `target`, a model of `source`'s config, `source`'s `QuantLinear`s: the same block arrays
    (shared), each bias left abstract in `dtype` for the caller to fill (as `models.transformer.rebuild` fills)."""
    def carried(ql: QuantLinear) -> QuantLinear:
        bias = None if ql.bias is None else nnx.Param(jax.ShapeDtypeStruct(ql.bias[...].shape, dtype))
        return QuantLinear([p[...] for p in ql.parts], bias)

    if isinstance(source.embed, EmbedBlocks):
        target.embed = EmbedBlocks(source.embed[...])
    for (sp, attr), (tp, _) in zip(_slots(source), _slots(target)):
        kept = getattr(sp, attr)
        if isinstance(kept, QuantLinear):
            setattr(tp, attr, carried(kept))
        elif isinstance(kept, QuantSwiGLU):
            setattr(tp, attr, QuantSwiGLU(carried(kept.gate_up), carried(kept.down)))


def dense_nbytes(model: nnx.Module) -> int:
    """Bytes of the dense projections `model` keeps in blocks."""
    embed = int(model.embed[...].nbytes) if isinstance(model.embed, EmbedBlocks) else 0
    return embed + sum(getattr(p, a).nbytes for p, a in dense_blocks_of(model))


__all__ = ["QuantLinear", "QuantSwiGLU", "DenseBlocks", "EmbedBlocks", "embed_lookup", "tied_head", "install_dense",
           "carry_dense", "dense_path", "param_path", "dense_kind", "dense_blocks_of", "dense_nbytes", "ATTENTION_LINEARS",
           "SWIGLU_MODULES", "as_quant", "blocks3"]
