"""HF FP8 checkpoints (models/fp8.py): a tiny block-scaled e4m3 checkpoint written as DeepSeek-V3 / Qwen3-FP8 ship
them (torch.float8_e4m3fn weights, float32 `weight_scale_inv` per block, `quantization_config` in config.json) loads
to exactly the model of its dequantized weights; a missing or mis-shaped scale is a one-line error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from models.fp8 import dequantize, is_fp8_checkpoint, open_fp8
from models.hf import CheckpointError, load_hf
from tests.hf_tiny import hf_model

BLOCK = (16, 16)  # tiny widths (12, 32, 40 ...) leave partial edge blocks, as 128 does for real ones
E4M3_MAX = 448.0


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale_inv) with one scale per block: amax / 448, as DeepSeek's quantizer picks it."""
    out, inp = w.shape
    rows, cols = math.ceil(out / BLOCK[0]), math.ceil(inp / BLOCK[1])
    scale = torch.zeros(rows, cols)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            block = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            s = block.abs().max().clamp(min=1e-12) / E4M3_MAX
            scale[i, j] = s
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (block / s).to(torch.float8_e4m3fn)
    return q, scale


def _is_quantized(name: str, t: torch.Tensor) -> bool:
    """The linears DeepSeek-V3's FP8 release quantizes: not embeddings, LM head, norms or routers."""
    return (t.ndim == 2 and name.endswith("proj.weight") or name.endswith((".w1.weight", ".w2.weight", ".w3.weight")))


def _write_fp8(family: str, folder: Path) -> Path:
    plain = folder / "plain"
    hf_model(family).save_pretrained(plain)
    state = load_file(str(plain / "model.safetensors"))
    out = {}
    for name, t in state.items():
        if _is_quantized(name, t):
            out[name], out[name + "_scale_inv"] = _quantize(t.float())
        else:
            out[name] = t.to(torch.bfloat16)
    fp8 = folder / "fp8"
    fp8.mkdir()
    save_file(out, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (fp8 / "config.json").write_text(json.dumps(config))
    # the reference: the same checkpoint with every FP8 weight dequantized, as float32
    ref = {n: (torch.from_numpy(dequantize(out[n].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn),
                                           out[n + "_scale_inv"].numpy(), BLOCK))
               if n + "_scale_inv" in out else out[n].float()) for n in state}
    (folder / "deq").mkdir()
    save_file(ref, str(folder / "deq" / "model.safetensors"), metadata={"format": "pt"})
    (folder / "deq" / "config.json").write_text((plain / "config.json").read_text())
    return fp8


def _params(model) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path, family) -> None:
    fp8 = _write_fp8(family, tmp_path)
    assert is_fp8_checkpoint(fp8) and not is_fp8_checkpoint(tmp_path / "deq")
    ck = open_fp8(fp8)
    assert not any(k.endswith("_scale_inv") for k in ck.reader.keys())
    assert ck.reader.run_dtype == ml_dtypes.bfloat16  # dtype=auto: the release's own bf16, not the f32 views
    _, got = load_hf(fp8, opened=ck)
    _, ref = load_hf(tmp_path / "deq")
    a, b = _params(ref), _params(got)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(b[key], a[key], err_msg=key)
    # and the dequantized weights are the original ones within e4m3's rounding (3 mantissa bits: 2^-4 relative)
    orig = load_file(str(tmp_path / "plain" / "model.safetensors"))
    name = next(n for n in orig if "experts" in n and n.endswith("weight"))
    piece = next(p for s in ck.sources for p in s.pieces if p.name == name)
    w = orig[name].numpy()
    assert np.abs(ck.reader.view(piece) - w).max() <= np.abs(w).max() * 2.0 ** -4


def test_missing_or_misshapen_scale_is_named(tmp_path) -> None:
    fp8 = _write_fp8("qwen3_moe", tmp_path)
    state = load_file(str(fp8 / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    state[name + "_scale_inv"] = torch.ones(1, 1)
    save_file(state, str(fp8 / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        open_fp8(fp8)
    assert name + "_scale_inv" in str(err.value) and "[2, 3]" in str(err.value) and "\n" not in str(err.value)
    del state[name + "_scale_inv"]
    save_file(state, str(fp8 / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"FP8 tensor {name} has no {name}_scale_inv"):
        open_fp8(fp8)
