"""GGUF files as checkpoints (models/gguf.py): every family's tiny random HF checkpoint converted by the project's
converter (engine/bench/peers/to_gguf.py, llama.cpp's names and transforms) loads to the same config and the same
parameters as the HF folder; quantized experts stay in their blocks as views of the file; bad files are one-line
errors before any tensor is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.bench.peers.to_gguf import convert
from models.gguf import SUPPORTED_ARCHES, open_gguf, read_gguf_config, rope_halves_from_pairs
from models.hf import CheckpointError, load_hf, read_config
from models.transformer import forward, init_cache
from tests.hf_tiny import FAMILIES, hf_model

_MSCALE_NOTE = "PhiMoE: GGUF keeps one rope magnitude scale (rope.scaling.attn_factor) for short and long"


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny checkpoint in the per-expert layout `save_pretrained` writes (as llama.cpp reads)."""
    root = tmp_path_factory.mktemp("gguf_hf")
    out = {}
    for family in FAMILIES:
        folder = root / family
        hf_model(family).save_pretrained(folder)
        out[family] = folder
    return out


def _gguf(hf_folders: dict[str, Path], family: str, name: str = "f32", **kw: Any) -> Path:
    dst = hf_folders[family] / f"{name}.gguf"
    if not dst.is_file():
        convert(hf_folders[family], dst, dense="f32", **kw)
    return dst


def _params(model: Any) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_loads_as_the_hf_checkpoint(hf_folders, family) -> None:
    """Config from the metadata and every parameter bit for bit (q/k rope order and split kv_b undone)."""
    ck = open_gguf(_gguf(hf_folders, family))
    want = read_config(hf_folders[family])
    if family == "phimoe":  # the one thing GGUF cannot say; the file's scale is llama.cpp's formula
        assert ck.cfg.rope_scaling.short_mscale == ck.cfg.rope_scaling.long_mscale, _MSCALE_NOTE
        want = want.replace(rope_scaling=ck.cfg.rope_scaling)
    assert ck.cfg == want
    _, ref = load_hf(hf_folders[family])
    _, got = load_hf(ck.folder, opened=ck)
    a, b = _params(ref), _params(got)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(b[key], a[key], err_msg=f"{family} {key}")


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "phimoe"])
def test_gguf_logits_equal_hf(hf_folders, family) -> None:
    """End to end through the forward pass (equal parameters imply it; this runs the compiled model)."""
    _, ref = load_hf(hf_folders[family])
    ck = open_gguf(_gguf(hf_folders, family))
    _, got = load_hf(ck.folder, opened=ck)
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 97, (2, 10)))
    positions = jnp.tile(jnp.arange(10), (2, 1))

    def logits(model: Any) -> np.ndarray:
        return np.asarray(forward(model, tokens, init_cache(model, 2, 16), positions)[0])

    np.testing.assert_array_equal(logits(got), logits(ref))


def test_rope_unpermute_inverts_llama_cpp_permutation() -> None:
    from engine.bench.peers.to_gguf import rope_pairs_from_halves

    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    assert not np.array_equal(rope_pairs_from_halves(w, 4), w)
    np.testing.assert_array_equal(rope_halves_from_pairs(rope_pairs_from_halves(w, 4), 4), w)


def _q8_folder(hf_folders: dict[str, Path]) -> Path:
    """Qwen3-MoE tiny with expert widths that are whole Q8_0 blocks (32)."""
    from transformers import AutoModelForCausalLM

    from tests.hf_tiny import hf_config

    cfg = hf_config("qwen3_moe")
    cfg.moe_intermediate_size = 32
    cfg.num_hidden_layers = 2  # one MoE layer, one dense (mlp_only_layers=[1]): a short compile
    folder = hf_folders["qwen3_moe"].parent / "qwen3_q8"
    if not (folder / "config.json").is_file():
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


def test_q8_0_experts_stay_in_their_blocks(hf_folders) -> None:
    """Q8_0 experts: QuantArray views of the mapped file (no copy), dequantized view = the file's blocks; the
    model built from them equals the HF model whose experts are those dequantized weights."""
    folder = _q8_folder(hf_folders)
    path = folder / "q8.gguf"
    if not path.is_file():
        convert(folder, path, dense="f32", experts="q8_0")
    ck = open_gguf(path)
    mapped = ck.reader.file.reader.data
    pieces = [(src, p) for src in ck.sources if src.expert is not None for p in src.pieces]
    assert pieces
    for src, piece in pieces[:6]:
        q = ck.reader.quant(piece)
        assert q.qtype == "q8_0" and q.shape == piece.shape
        assert np.shares_memory(q.data, mapped)
        deq = gguf.quants.dequantize(np.asarray(q.data), gguf.GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(ck.reader.view(piece), deq)
    # the weights the blocks hold are the HF weights within Q8_0's rounding: half a step of scale d = amax / 127,
    # plus d's own f16 rounding (2^-11 relative) times up to 127 steps
    hf = read_config(folder)
    _, ref = load_hf(folder)
    _, got = load_hf(path, opened=ck)
    a, b = _params(ref), _params(got)
    expert_keys = [k for k in a if "'experts'" in k]
    assert expert_keys and hf == ck.cfg
    for key in a:
        if key in expert_keys:
            err = np.abs(b[key] - a[key]).max()
            assert 0 < err <= np.abs(a[key]).max() / 127 * (0.5 + 127 * 2.0 ** -11), key
        else:
            np.testing.assert_array_equal(b[key], a[key], err_msg=key)


def test_bf16_gguf_keeps_bf16_experts_as_views(hf_folders) -> None:
    path = hf_folders["olmoe"] / "bf16.gguf"
    convert(hf_folders["olmoe"], path)  # the converter's default: bf16 matrices, f32 norms and router
    ck = open_gguf(path)
    assert ck.stored_dtype() == jnp.bfloat16
    src = next(s for s in ck.sources if s.expert is not None)
    q = ck.reader.quant(src.pieces[0])
    assert q.qtype == "bf16" and np.shares_memory(q.data, ck.reader.file.reader.data)
    assert np.shares_memory(ck.reader.view(src.pieces[0]), ck.reader.file.reader.data)


# ---- bad input ------------------------------------------------------------------------------------------


def _rewrite(src: Path, dst: Path, arch: Optional[str] = None, fields: Optional[dict[str, Any]] = None,
             tensors: Optional[dict[str, Callable[[Any], tuple[np.ndarray, Any]]]] = None) -> Path:
    """Copy a GGUF file changing its architecture, some metadata values (same types) or some tensors
    (name -> f(ReaderTensor) giving (array, raw ggml type))."""
    r = gguf.GGUFReader(src)
    old_arch = str(r.get_field("general.architecture").contents())
    arch = arch or old_arch
    w = gguf.GGUFWriter(dst, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):  # the writer's own
            continue
        value = (fields or {}).get(key, field.contents())
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key.replace(f"{old_arch}.", f"{arch}.", 1), value, field.types[0], sub_type=sub)
    for t in r.tensors:
        make = (tensors or {}).get(t.name)
        data, qtype = make(t) if make else (np.asarray(t.data), t.tensor_type)
        w.add_tensor(t.name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_unsupported_expert_type_names_tensor_and_types(hf_folders, tmp_path) -> None:
    def q5_1(t: Any) -> tuple[np.ndarray, Any]:  # a type no moescope kernel serves
        return gguf.quants.quantize(np.asarray(t.data), gguf.GGMLQuantizationType.Q5_1), gguf.GGMLQuantizationType.Q5_1

    bad = _rewrite(_gguf(hf_folders, "olmoe"), tmp_path / "q5.gguf", tensors={"blk.1.ffn_up_exps.weight": q5_1})
    with pytest.raises(CheckpointError) as err:
        open_gguf(bad)
    msg = str(err.value)
    assert "blk.1.ffn_up_exps.weight" in msg and "Q5_1" in msg and "Q8_0" in msg and "Q4_K" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("arch", ["qwen2moe", "bert"])
def test_unsupported_architecture_names_it(hf_folders, tmp_path, arch) -> None:
    bad = _rewrite(_gguf(hf_folders, "mixtral"), tmp_path / f"{arch}.gguf", arch=arch)
    with pytest.raises(CheckpointError) as err:
        read_gguf_config(bad)
    msg = str(err.value)
    assert repr(arch) in msg and all(a in msg for a in SUPPORTED_ARCHES) and "\n" not in msg


def test_dense_llama_is_refused(hf_folders, tmp_path) -> None:
    bad = _rewrite(_gguf(hf_folders, "mixtral"), tmp_path / "dense.gguf", fields={"llama.expert_count": 0})
    with pytest.raises(CheckpointError, match="dense model"):
        open_gguf(bad)


@pytest.mark.parametrize("cut", [100, 4000, 1])
def test_truncated_file_names_it(hf_folders, tmp_path, cut) -> None:
    src = _gguf(hf_folders, "deepseek_v2")
    data = src.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut] if cut == 100 else data[:-cut])
    with pytest.raises(CheckpointError) as err:
        open_gguf(bad)
    assert str(bad) in str(err.value) and "truncated" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key, value, tensor", [
    ("llama.expert_count", 8, "blk.0.ffn_gate_exps.weight"),
    ("llama.embedding_length", 48, "token_embd.weight"),
    ("llama.block_count", 2, "blk.2.attn_norm.weight"),
    ("llama.attention.head_count_kv", 4, "blk.0.attn_k.weight"),
])
def test_metadata_disagreeing_with_shapes_names_key_and_tensor(hf_folders, tmp_path, key, value, tensor) -> None:
    bad = _rewrite(_gguf(hf_folders, "mixtral"), tmp_path / "meta.gguf", fields={key: value})
    with pytest.raises(CheckpointError) as err:
        open_gguf(bad)
    msg = str(err.value)
    assert key in msg and (tensor in msg or "blocks" in msg) and "\n" not in msg


def test_deepseek_expert_width_disagreeing_names_key(hf_folders, tmp_path) -> None:
    bad = _rewrite(_gguf(hf_folders, "deepseek_v3"), tmp_path / "ff.gguf",
                   fields={"deepseek2.expert_feed_forward_length": 16})
    with pytest.raises(CheckpointError, match=r"deepseek2\.expert_feed_forward_length = 16 .*ffn_gate_exps"):
        open_gguf(bad)


@pytest.mark.slow  # two forwards: 48 s measured on the shared 2-core machine under load
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_block_experts_serve_as_their_dequantized_weights(hf_folders, qtype) -> None:
    """The file's expert blocks installed as QuantExperts (the block-kernel path) give the logits of the model whose
    experts are those blocks dequantized in float32, within the kernels' Q8_0 activation rounding (per 32 values, as
    llama.cpp's integer dot products; the kernels themselves are checked exactly against it in test_native_quant)."""
    from models.gguf import block_experts, has_block_experts
    from models.quant.experts import install

    folder = _q8_folder(hf_folders)
    path = folder / f"{qtype}.gguf"
    if not path.is_file():
        convert(folder, path, dense="f32", experts=qtype)
    ck = open_gguf(path)
    assert has_block_experts(ck)
    experts = block_experts(ck)
    assert sorted(experts) == list(ck.cfg.moe_layers)
    gate_up, down = experts[ck.cfg.moe_layers[0]]
    (gate, up), mapped = gate_up[0], ck.reader.file.reader.data
    assert gate.qtype == up.qtype == down[0].qtype == qtype
    assert all(np.shares_memory(q.data, mapped) for q in (gate, up, down[0]))  # no copy of any expert
    _, deq = load_hf(path, opened=ck)
    _, blocks = load_hf(path, opened=ck, with_experts=False)
    install(blocks, experts)
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 97, (2, 10)))
    positions = jnp.tile(jnp.arange(10), (2, 1))
    a = np.asarray(forward(deq, tokens, init_cache(deq, 2, 16), positions)[0])
    b = np.asarray(forward(blocks, tokens, init_cache(blocks, 2, 16), positions)[0])
    scale = max(1.0, float(np.abs(a).max()))
    assert 0 < np.abs(b - a).max() <= 1e-3 * scale  # the activation rounding is there (~1e-4 measured), and only it


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k"])
def test_k_quant_experts_stay_in_their_blocks(hf_folders, qtype) -> None:
    """Q4_K / Q6_K experts (the Q4_K_M preset's types; 256-weight super-blocks, so 256-wide experts): QuantArray views
    of the file whose dequantization (the gguf package's, independent of moescope's) is what the reader serves."""
    from transformers import AutoModelForCausalLM

    from tests.hf_tiny import hf_config

    cfg = hf_config("qwen3_moe")
    cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_hidden_layers, cfg.mlp_only_layers = 256, 256, 1, []
    folder = hf_folders["qwen3_moe"].parent / "qwen3_k"
    if not (folder / "config.json").is_file():
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    path = folder / f"{qtype}.gguf"
    convert(folder, path, experts=qtype)
    ck = open_gguf(path)
    ggml = gguf.GGMLQuantizationType[qtype.upper()]
    _, ref = load_hf(folder)
    a = _params(ref)
    for src in [s for s in ck.sources if s.expert is not None][:4]:
        for piece in src.pieces:
            q = ck.reader.quant(piece)
            assert q.qtype == qtype and np.shares_memory(q.data, ck.reader.file.reader.data)
            deq = gguf.quants.dequantize(np.asarray(q.data), ggml)
            np.testing.assert_array_equal(ck.reader.view(piece), deq)
    key = next(k for k in a if "'experts'" in k and "'down'" in k)
    _, got = load_hf(path, opened=ck, dtype=jnp.float32)
    w, err = a[key], np.abs(_params(got)[key] - a[key]).max()
    assert 0 < err < np.abs(w).max() * (0.15 if qtype == "q4_k" else 0.04)  # 4-bit / 6-bit steps
