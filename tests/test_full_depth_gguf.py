"""The full-depth GGUF writer (engine.bench.full_depth_gguf) at tiny depth and width: the file it writes is a
GGUF moescope loads with the released model's tensor names, shapes and the per-tensor types of llama.cpp's
preset, random blocks whose weights have the intended spread, and a tokenizer both loaders take.
(llama.cpp loading the same files is checked by `engine.bench.bench_full_depth`, outside CI.)"""

from __future__ import annotations

import numpy as np
import pytest

from engine.bench import full_depth_gguf as fd
from models.gguf import GGUFFile, block_experts, open_gguf
from models.gguf_tokenizer import tokenizer_from_gguf
from models.quant.experts import layer_formats
from models.quant.formats import dequantize

TINY_QWEN = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, vocab_size=640)
TINY_DEEPSEEK = dict(num_experts=4, vocab_size=640, hidden_size=256, moe_intermediate_size=256,
                     intermediate_size=512, num_attention_heads=4, num_key_value_heads=4)


@pytest.fixture(scope="module")
def qwen_file(tmp_path_factory):
    cfg = fd.model_config("qwen3_moe", 8, **TINY_QWEN)
    path = tmp_path_factory.mktemp("fd") / "qwen.gguf"
    info = fd.write(cfg, "q4_k_m", path, drop_cache=False)
    return cfg, path, info


def test_q4_k_m_file_loads_with_the_presets_types(qwen_file) -> None:
    cfg, path, info = qwen_file
    ck = open_gguf(path)
    assert (ck.cfg.num_hidden_layers, ck.cfg.num_experts, ck.cfg.hidden_size, ck.cfg.moe_intermediate_size,
            ck.cfg.head_dim, ck.cfg.vocab_size) == (8, 4, 256, 256, 64, 640)
    f = GGUFFile(path)
    assert f.get("general.file_type") == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    # experts: gate/up Q4_K, down Q6_K exactly in the layers llama.cpp's use_more_bits picks (as moescope's
    # quantize-on-load preset does it), the rest Q4_K
    want = layer_formats(ck.cfg, "q4_k_m")
    assert {f.type_name(f"blk.{i}.ffn_down_exps.weight") for i in range(8)} == {"Q4_K", "Q6_K"}
    for layer, (pairs, downs) in block_experts(ck).items():
        assert pairs[0][0].qtype == want[layer].gate_up == "q4_k"
        assert downs[0].qtype == want[layer].down
    # dense tensors: output Q6_K, attn_v by the same rule, the rest Q4_K; router and norms F32
    assert f.type_name("output.weight") == "Q6_K" and f.type_name("token_embd.weight") == "Q4_K"
    assert f.type_name("blk.0.attn_v.weight") == "Q6_K" and f.type_name("blk.1.attn_v.weight") == "Q4_K"
    assert f.type_name("blk.3.ffn_gate_inp.weight") == "F32" and f.type_name("blk.3.attn_norm.weight") == "F32"
    assert info["bytes_by_type"]["Q6_K"] > 0 and sum(info["bytes_by_type"].values()) < info["bytes"]


def test_random_blocks_have_a_small_finite_spread(qwen_file) -> None:
    _, path, _ = qwen_file
    ck = open_gguf(path)
    pairs, downs = block_experts(ck)[2]  # a Q6_K-down layer
    for q in (pairs[0][0], downs[1]):
        w = dequantize(np.asarray(q.data), q.qtype, q.shape[1])
        assert np.isfinite(w).all()
        assert 0.01 < float(w.std()) < 0.04 and abs(float(w.mean())) < 0.005, (q.qtype, w.std(), w.mean())
    norm = GGUFFile(path).floats("blk.0.attn_norm.weight")
    assert (norm == 1).all()


def test_tokenizer_round_trips_and_keeps_special_ids(qwen_file) -> None:
    cfg, path, _ = qwen_file
    tok = tokenizer_from_gguf(path)
    assert tok.get_vocab_size() == 640
    ids = tok.encode("Hello world, 42!").ids
    assert tok.decode(ids) == "Hello world, 42!"
    alpha = fd.byte_chars()
    assert tok.token_to_id(alpha[0] + alpha[1]) == 257 and tok.token_to_id(alpha[65] + alpha[66]) is None  # pairs
    f = GGUFFile(path)
    tokens = f.get("tokenizer.ggml.tokens")
    assert tokens[f.get("tokenizer.ggml.eos_token_id")] == "<|im_end|>"


@pytest.fixture(scope="module")
def deepseek_file(tmp_path_factory):
    cfg = fd.model_config("deepseek_v2", 3, **TINY_DEEPSEEK)
    path = tmp_path_factory.mktemp("fd") / "ds.gguf"
    fd.write(cfg, "q8_0", path, drop_cache=False)
    return path


def test_deepseek_q8_0_file_has_every_matrix_in_q8_0(deepseek_file) -> None:
    f = GGUFFile(deepseek_file)
    assert f.get("general.file_type") == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    types = {f.type_name(n) for n in f.tensors if len(f.shape(n)) >= 2 and "gate_inp" not in n}
    assert types == {"Q8_0"}  # every matrix, the split MLA attn_k_b / attn_v_b included
    assert {"blk.1.attn_k_b.weight", "blk.1.ffn_down_shexp.weight", "blk.0.ffn_down.weight"} <= set(f.tensors)
    got = open_gguf(deepseek_file).cfg
    assert (got.first_k_dense_replace, got.n_shared_experts, got.kv_lora_rank, got.num_experts) == (1, 2, 512, 4)


@pytest.mark.slow
def test_deepseek_q8_0_file_generates(deepseek_file) -> None:
    from conf import compose
    from models.generation import Generator
    from models.loading import load_model

    path = deepseek_file
    spec = compose("generate", [f"model.checkpoint={path}", "model.arch=null"]).model
    _, model, _ = load_model(spec, dtype="float32")
    out = Generator(model).generate([[5, 6, 7, 8]], 3)
    assert out.tokens.shape == (1, 3) and (out.tokens < 640).all()


def test_unknown_preset_is_refused(tmp_path) -> None:
    cfg = fd.model_config("qwen3_moe", 2, **TINY_QWEN)
    with pytest.raises(ValueError, match="q8_0, q4_k_m"):
        fd.write(cfg, "q5_k_m", tmp_path / "x.gguf")


def test_experts_alias_the_mapping_at_64_byte_alignment(qwen_file) -> None:
    """The file's tensors start 64-byte aligned, so the in-memory model's expert arrays are the mapped file's
    bytes (XLA:CPU aliases only 64-byte-aligned host buffers; GGUF's default 32 leaves them copied half the
    time), and the heap is trimmed after loading."""
    from conf import compose
    from models.gguf import unaliasable_expert_bytes
    from models.loading import load_model

    _, path, _ = qwen_file
    f = GGUFFile(path)
    assert f.get("general.alignment") == 64 and unaliasable_expert_bytes(f) == 0
    spec = compose("generate", [f"model.checkpoint={path}", "model.arch=null"]).model
    _, model, _ = load_model(spec, dtype="bfloat16")
    ranges = []  # the address ranges this process maps the file at (/proc/self/maps)
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(str(path.resolve())):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((lo, hi))
    assert ranges
    experts = model.layers[1].moe.experts
    for arr in experts.stacks():  # each layer's stacked expert tensors, as the file holds them
        assert any(lo <= arr.unsafe_buffer_pointer() < hi for lo, hi in ranges)


def program_parameters(model) -> int:
    """Parameters of the generator's prefill program (batch 1, 16 tokens), counted in its StableHLO."""
    import jax
    import jax.numpy as jnp

    from models.generation import Generator
    from models.transformer import init_cache

    gen = Generator(model)
    text = gen._prefill.lower(gen.state, init_cache(model, 1, 64, jnp.bfloat16), jnp.full((1, 16), 7, jnp.int32),
                              jnp.ones((1, 16), bool), jax.random.PRNGKey(0), jnp.zeros((2,), jnp.float32)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main(" in line)
    return main.count("%arg")


def test_program_parameters_do_not_grow_with_the_experts(tmp_path) -> None:
    """A GGUF model's routed experts reach its programs as each layer's three stacked tensors, views of the mapped
    file: the prefill program of a 16-expert file has as many parameters as a 4-expert one's (with an array per
    expert, XLA:CPU kept ~5 MB of per-parameter state per Qwen3-30B-A3B layer in every compiled program: ~0.5 GB per
    batch size at 48 layers). The experts then are still bit for bit those of the file."""
    from models.loading import load_model
    from models.quant.experts import StackedQuantExperts

    counts = {}
    for E in (4, 16):
        path = tmp_path / f"qwen-E{E}.gguf"
        fd.write(fd.model_config("qwen3_moe", 2, **{**TINY_QWEN, "num_experts": E}), "q4_k_m", path, drop_cache=False)
        _, model, _ = load_model({"checkpoint": str(path), "arch": None, "name": "tiny"}, dtype="bfloat16")
        experts = model.layers[0].moe.experts
        assert isinstance(experts, StackedQuantExperts) and experts.num_experts == E
        gate_up, down = block_experts(open_gguf(path))[0]  # per-expert views of the file
        (gate, up), got_down = experts.arrays()[0][3], experts.arrays()[1][3]
        assert all(np.array_equal(a.data, b.data) and a.qtype == b.qtype
                   for a, b in ((gate, gate_up[3][0]), (up, gate_up[3][1]), (got_down, down[3])))
        counts[E] = program_parameters(model)
    assert counts[4] == counts[16], counts


@pytest.mark.slow
def test_stacked_experts_give_the_per_expert_logits(tmp_path) -> None:
    """The stacked experts' programs compute bit for bit what per-expert views did (the same native kernel, each
    expert read at its offset in the stack): teacher-forced logits after a prefill and decode steps, batch 3, on a
    2-layer file with Q4_K_M's two layer structures (Q6_K and Q4_K down)."""
    from models.generation import Generator
    from models.gguf import block_experts
    from models.loading import load_model
    from models.quant.experts import install

    path = tmp_path / "qwen.gguf"
    fd.write(fd.model_config("qwen3_moe", 2, **{**TINY_QWEN, "num_experts": 8}), "q4_k_m", path, drop_cache=False)
    spec = {"checkpoint": str(path), "arch": None, "name": "tiny"}
    prompts, forced = [[5, 9, 300, 41, 8], [17, 2, 90], [1, 2, 3, 4, 5, 6, 7]], np.array([[11, 12, 13]] * 3)
    stacked = Generator(load_model(spec, dtype="bfloat16")[1]).forced_logits(prompts, forced)
    model = load_model(spec, dtype="bfloat16")[1]
    install(model, block_experts(open_gguf(path)))  # one array per expert, as before
    per_expert = Generator(model).forced_logits(prompts, forced)
    assert np.isfinite(stacked).all() and np.abs(stacked).max() > 0
    np.testing.assert_array_equal(stacked, per_expert)
