"""Quantized experts in the model: `model.expert_format` on load, the saved quantized folder (mapped, not
copied), and the offloaded run of a quantized model against its own in-memory run."""

from pathlib import Path

import numpy as np
import pytest

from models.generation import Generator
from models.hf import open_checkpoint
from models.loading import load_model
from models.quant.checkpoint import save_quantized
from models.quant.experts import QuantExperts, layer_formats, use_more_bits
from models.quant.formats import quantize

TINY = "pkg:models/checkpoints/mixtral-tiny"
PROMPTS = [[5, 17, 301, 44, 9, 1200, 77, 3], [88, 12, 4000, 3, 19]]


def spec(fmt: str, checkpoint: str = TINY) -> dict:
    return {"name": "mixtral-tiny", "checkpoint": checkpoint, "expert_format": fmt}


def test_unknown_expert_format_is_a_one_line_error():
    with pytest.raises(ValueError) as err:
        load_model(spec("q3_k"))
    msg = str(err.value)
    assert "\n" not in msg and "model.expert_format='q3_k'" in msg and "q8_0" in msg and "q4_k_m" in msg


def test_block_size_that_does_not_divide_the_rows_names_the_tensor():
    """deepseek-tiny's experts have rows of 96 (gate/up) and 48 (down): q8_0's 32-weight blocks do not divide 48."""
    with pytest.raises(ValueError, match=r"^model.expert_format: layer 1 experts' down \[96, 48\] has rows of 48"):
        load_model(spec("q8_0", "pkg:models/checkpoints/deepseek-tiny"))


def test_q4_k_m_follows_llama_cpp_more_bits_layers():
    # llama.cpp's layers for 32 and 8 blocks: first and last eighth, and every third from n/8 + 2
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    from models.hf import read_config
    from core.config import resolve_path

    cfg = read_config(resolve_path(TINY)).replace(hidden_size=256, intermediate_size=512)
    fmts = layer_formats(cfg, "q4_k_m")
    assert {f.gate_up for f in fmts.values()} == {"q4_k"}
    assert [f.down for f in fmts.values()] == ["q6_k" if use_more_bits(i, 8) else "q4_k" for i in range(8)]
    tiny = layer_formats(read_config(resolve_path(TINY)), "q4_k_m")  # rows of 128: llama.cpp's fallbacks
    assert {(f.gate_up, f.down) for f in tiny.values()} == {("q5_0", "q8_0"), ("q5_0", "q5_0")}


def test_quantize_on_load_holds_the_checkpoint_experts_blocks():
    cfg, model, _ = load_model(spec("q8_0"), dtype="auto")
    experts = model.layers[2].moe.experts
    assert isinstance(experts, QuantExperts) and experts.gate_up_type == experts.down_type == "q8_0"
    ck = open_checkpoint(Path("models/checkpoints/mixtral-tiny"))
    name = "model.layers.2.block_sparse_moe.experts.5.w2.weight"
    down = ck.reader.view(next(p for s in ck.sources for p in s.pieces if p.name == name))
    np.testing.assert_array_equal(np.asarray(experts.arrays()[1][5].data), quantize(np.asarray(down, np.float32), "q8_0"))


def mapped_file(address: int) -> str:
    """The file whose mapping holds `address` in this process ('' when anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        if lo <= address < hi:
            return parts[5] if len(parts) > 5 else ""
    return ""


def matrices(experts: QuantExperts) -> list:
    gate_up, down = experts.arrays()
    return [q for pair in gate_up for q in pair] + down


def test_saved_quantized_checkpoint_loads_mapped(tmp_path):
    cfg, model, folder = load_model(spec("q4_k_m"), dtype="auto")
    save_quantized(model, tmp_path / "q", "q4_k_m", source=folder)
    cfg2, loaded, folder2 = load_model({"name": "saved", "checkpoint": str(tmp_path / "q")}, dtype="auto")
    assert cfg2 == cfg and (folder2 / "tokenizer.json").is_file()
    for layer in cfg.moe_layers:
        a, b = model.layers[layer].moe.experts, loaded.layers[layer].moe.experts
        assert (a.gate_up_type, a.down_type) == (b.gate_up_type, b.down_type)
        for x, y in zip(matrices(a), matrices(b)):
            np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data))
            # no copy: the model's block bytes are the mapped experts file's pages
            assert mapped_file(y.data.unsafe_buffer_pointer()) == str(tmp_path / "q" / "experts.safetensors")
    # (generation runs the same QuantExperts as the quantize-on-load model: see the offloaded test)
    with pytest.raises(ValueError, match="holds q4_k_m experts"):
        load_model({"name": "saved", "checkpoint": str(tmp_path / "q"), "expert_format": "q8_0"})


@pytest.mark.parametrize("fmt", ["q8_0", pytest.param("q4_k_m", marks=pytest.mark.slow)])
def test_offloaded_quantized_model_gives_its_in_memory_tokens(fmt):
    """Transfers move the block bytes, device experts dequantize them inside the jitted expert, CPU experts run
    on them: the tokens of every plan equal the quantized model's own in-memory tokens."""
    from engine.offload.executor import OffloadExecutor, OffloadSettings
    from engine.offload.store import ExpertStore
    from schedulers.base import OFFLOAD, SchedulerSetup, build_scheduler
    from schedulers.cost import CostModel
    from schedulers.hardware import load_hardware

    cfg, model, _ = load_model(spec(fmt), dtype="auto")
    store = ExpertStore.from_model(model)
    L, E = len(cfg.moe_layers), cfg.num_experts
    H, F = cfg.hidden_size, cfg.expert_intermediate_size
    fmts = layer_formats(cfg, fmt)
    from models.quant.blocks import block_type

    want = [2 * F * block_type(fmts[l].gate_up).row_bytes(H) + H * block_type(fmts[l].down).row_bytes(F)
            for l in cfg.moe_layers]
    assert store.expert_bytes == round(sum(want) / L) < cfg.expert_bytes(2) * 0.6
    assert np.shares_memory(store.part(0, 3, "down"), np.asarray(model.layers[0].moe.experts.down[3][...]))
    ref = Generator(model).generate(PROMPTS, 5, pad_token_id=cfg.pad_token_id)
    cost = CostModel(cfg, load_hardware("local_cpu"), expert_bytes=store.expert_bytes)
    assert cost.expert_bytes == store.expert_bytes
    for kind, slots in (("presched", L), ("ondemand", 2 * L)):
        sched = build_scheduler(OFFLOAD.get(kind).settings(label=kind),
                                SchedulerSetup(L, E, cfg.num_experts_per_tok, slots, cost,
                                               np.arange(L * E).reshape(L, E) % 5))
        with OffloadExecutor(model, store, sched, cost, OffloadSettings(cache_slots=slots)) as ex:
            out = ex.generate(PROMPTS, 5, pad_token_id=cfg.pad_token_id)
            assert ex.cache.gate_up[0].dtype == np.uint8
        np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=f"{fmt} {kind}")


def test_a_quantized_model_rebuilt_in_another_dtype_shares_its_block_experts():
    """engine.run's float32 envelope reference (`rebuild`) and its offload model (`without_experts`)."""
    import jax.numpy as jnp

    from models.transformer import rebuild, without_experts

    cfg, model, _ = load_model(spec("q8_0"), dtype="auto")
    f32 = rebuild(model, jnp.float32)
    assert f32.embed[...].dtype == jnp.float32
    for layer in cfg.moe_layers:
        assert f32.layers[layer].moe.experts is model.layers[layer].moe.experts
    assert without_experts(model).layers[0].moe.experts is None
