"""The one place a quantized expert is computed: where moescope's native quantized kernels plug in.

`expert_swiglu` (inside jitted code: the in-memory model's experts and the offload executor's device
experts) and `host_expert` (host numpy/torch: the offload executor's CPU experts) are the only calls
that multiply by quantized weights. Today both take the portable path: dequantize the blocks to
float32 (`models.quant.formats`, ggml's arithmetic, bit-exact with gguf-py), then a float32 SwiGLU
with float32 activations, so the result is "dequantize, then an f32 matmul" exactly. A native kernel
(`models/native`, quantized dot products) replaces the body of these two functions and nothing else.
"""

from __future__ import annotations

from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import swiglu
from models.quant.blocks import QuantArray
from models.quant.formats import dequantize, dequantize_jnp

Weight = Union[jax.Array, QuantArray, tuple]  # tuple: a quantized expert's (gate, up)


def is_quantized(w: Any) -> bool:
    """A QuantArray, or a quantized expert's (gate, up) pair."""
    return isinstance(w, QuantArray) or (isinstance(w, tuple) and bool(w) and isinstance(w[0], QuantArray))


def dense_weight(w: Weight) -> jax.Array:
    """A quantized matrix dequantized to float32 [rows, cols] (traceable); other weights as they are."""
    if isinstance(w, tuple):  # (gate, up): gate|up rows
        return jnp.concatenate([dense_weight(part) for part in w], axis=0)
    if isinstance(w, QuantArray):
        return dequantize_jnp(w.data, w.qtype, w.shape[1])
    return w


def expert_swiglu(x: jax.Array, gate_up: Weight, down: Weight) -> jax.Array:
    """One SwiGLU expert: x [T, H], gate|up rows [2F, H] (gate first; quantized: a QuantArray or a (gate, up) pair
    of QuantArrays), down [H, F] -> float32 [T, H].

    Quantized weights: dequantized inside the jitted program (only this expert's blocks, so a `switch`
    or `cond` around the call reads just the chosen experts' bytes), activations in float32."""
    if is_quantized(gate_up) or is_quantized(down):
        return swiglu(x.astype(jnp.float32), dense_weight(gate_up), dense_weight(down), jnp.float32)
    return swiglu(x, gate_up, down, jnp.float32)


def host_expert(x: np.ndarray, gate: QuantArray, up: QuantArray, down: QuantArray) -> np.ndarray:
    """One SwiGLU expert on the host: x float32 [T, H], gate/up [F, H], down [H, F] quantized -> float32 [T, H].

    The same arithmetic as `expert_swiglu` (dequantized blocks, float32 products), with torch's matmul."""
    import torch

    xt = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    w = [torch.from_numpy(dequantize(q.data, q.qtype, q.shape[1])) for q in (gate, up, down)]
    h = torch.nn.functional.silu(torch.nn.functional.linear(xt, w[0])) * torch.nn.functional.linear(xt, w[1])
    return torch.nn.functional.linear(h, w[2]).numpy()
