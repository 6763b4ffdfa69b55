"""Quantized experts from every source through the offloaded path (issue 28): a folder written by
`models.quant.save`, a GGUF file (stacked `ffn_*_exps` and the older per-expert Mixtral layout), quantize-on-load.

The host store views the source's blocks (no copy), the cost model takes the blocks' bytes and the block types'
CPU rates, and the offloaded run stays within the quantized model's own envelope for every policy (slow suite)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.offload.store import ExpertStore
from models.loading import load_model, open_model_checkpoint
from models.quant.checkpoint import save_quantized
from models.quant.experts import LayerFormat
from schedulers.cost import CostModel
from schedulers.formats import blocks_format, format_costs
from schedulers.hardware import ExpertTimes, load_hardware
from tests.test_quant_experts import mapped_file

TINY = "pkg:models/checkpoints/mixtral-tiny"


def per_expert_copy(src: Path, dst: Path) -> Path:
    """`src` with every stacked `blk.N.ffn_{gate,up,down}_exps.weight` written as one tensor per expert,
    `blk.N.ffn_gate.E.weight` (the layout older llama.cpp converters wrote for Mixtral); all else as it was."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), str(r.get_field("general.architecture").contents()))
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in r.tensors:
        data = np.asarray(t.data)
        if "_exps." in t.name:
            for e in range(data.shape[0]):
                w.add_tensor(t.name.replace("_exps.", f".{e}."), data[e], raw_dtype=t.tensor_type)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """The shipped tiny Mixtral with Q8_0 experts as a GGUF file (the project's converter, bf16 matrices), the same
    file in the per-expert layout, and a saved quantized folder (Q4_K_M: llama.cpp's fallback mix at rows of 128)."""
    from core.config import resolve_path
    from engine.bench.peers.to_gguf import convert

    root = tmp_path_factory.mktemp("quant_sources")
    stacked = root / "tiny-q8.gguf"
    convert(resolve_path(TINY), stacked, experts="q8_0")
    _, model, folder = load_model({"name": "q", "checkpoint": TINY, "expert_format": "q4_k_m"}, dtype="auto")
    save_quantized(model, root / "saved", "q4_k_m", source=folder)
    return {"gguf": str(stacked), "per_expert": str(per_expert_copy(stacked, root / "tiny-q8-per-expert.gguf")),
            "saved": str(root / "saved")}


@pytest.mark.parametrize("source", ["gguf", "saved"])
def test_store_from_checkpoint_maps_the_blocks(sources, source: str) -> None:
    """`ExpertStore.from_checkpoint` of a quantized source: every part a view of the source file's mapping, in the
    model's own blocks, and the bytes the cost model plans with."""
    path = sources[source]
    ck = open_model_checkpoint({"checkpoint": path})
    store = ExpertStore.from_checkpoint(ck, dtype=np.float32)
    cfg = ck.cfg
    assert store.quantized and len(store) == len(cfg.moe_layers) * cfg.num_experts and store.allocated_bytes == 0
    file = path if source != "saved" else str(Path(path) / "experts.safetensors")
    for layer, expert in ((0, 0), (3, 5), (len(cfg.moe_layers) - 1, cfg.num_experts - 1)):
        for part in store.numpy_views(layer, expert):
            assert mapped_file(part.ctypes.data) == file, (source, layer, expert)
    if source == "gguf":  # the converter writes 64-byte alignment: JAX aliases every expert instead of copying it
        from models.gguf import unaliasable_expert_bytes

        assert unaliasable_expert_bytes(ck.reader.file) == 0
    _, model, _ = load_model({"name": "q", "checkpoint": path})
    for m, layer in enumerate(cfg.moe_layers):
        (gate, up), down = (x[4] for x in model.layers[layer].moe.experts.arrays())
        for mine, theirs in zip(store.quant_views(m, 4), (gate, up, down)):
            assert mine.qtype == theirs.qtype
            np.testing.assert_array_equal(np.asarray(mine.data), np.asarray(theirs.data))
    fmt = store.cost_format()
    assert fmt["expert_format"] == ("q4_k_m" if source == "saved" else "q8_0")
    cost = CostModel(cfg, load_hardware("local_cpu"), expert_bytes=store.expert_bytes, **fmt)
    assert cost.expert_bytes == store.expert_bytes < cfg.expert_bytes(2) * 0.6


def test_a_per_expert_gguf_loads_as_its_stacked_twin(sources) -> None:
    """An older Mixtral GGUF (`blk.N.ffn_gate.E.weight` per expert) has the stacked file's config and each expert's
    blocks byte for byte, each a view of its own tensor in the mapping."""
    from models.gguf import is_expert_tensor, unaliasable_expert_bytes

    a = open_model_checkpoint({"checkpoint": sources["gguf"]})
    b = open_model_checkpoint({"checkpoint": sources["per_expert"]})
    assert a.cfg == b.cfg and "blk.0.ffn_down.7.weight" in b.reader.file.tensors
    assert is_expert_tensor("blk.0.ffn_down.7.weight") and not is_expert_tensor("blk.0.ffn_down.weight")
    # the per-expert tensors are the expert tensors whose alignment counts (the mapping starts on a page boundary)
    off = sum(int(t.n_bytes) for n, t in b.reader.file.tensors.items()
              if ".ffn_" in n and n.split(".")[-2].isdigit() and t.data_offset % 64)
    assert unaliasable_expert_bytes(b.reader.file) == off
    pieces = [p for s in a.sources if s.expert is not None for p in s.pieces]
    assert len(pieces) == 3 * len(a.cfg.moe_layers) * a.cfg.num_experts
    for piece in pieces:
        qa, qb = a.reader.quant(piece), b.reader.quant(piece)
        assert (qa.qtype, qa.shape) == (qb.qtype, qb.shape) == ("q8_0", piece.shape)
        np.testing.assert_array_equal(np.asarray(qb.data), np.asarray(qa.data))
        np.testing.assert_array_equal(b.reader.view(piece), a.reader.view(piece))
    assert np.shares_memory(qb.data, b.reader.file.reader.data)
    store = ExpertStore.from_checkpoint(b, dtype=np.float32)  # the offloaded store: each expert's own tensor, mapped
    for part in store.numpy_views(7, 3):
        assert mapped_file(part.ctypes.data) == sources["per_expert"]


def test_the_cost_model_plans_with_the_blocks_rates_and_a_measured_format() -> None:
    """Experts in blocks: eq. 2 scaled by their block types' rates (a GGUF's mix named by its preset or its types);
    times measured on quantized experts come back as measured for that format, and are converted for another."""
    from models.hf import read_config
    from core.config import resolve_path

    cfg = read_config(resolve_path(TINY)).replace(hidden_size=256, intermediate_size=512)
    hw = load_hardware("local_cpu")
    q4km = [LayerFormat("q4_k", "q6_k" if i in (0, 3, 6, 7) else "q4_k") for i in range(8)]
    assert blocks_format(cfg, q4km) == "q4_k_m"
    mix = [LayerFormat("q4_k", "q8_0")] * 8
    assert blocks_format(cfg, mix) == "q4_k+q8_0"
    bf16 = CostModel(cfg, hw)
    named = CostModel(cfg, hw, expert_format="q4_k_m")
    given = CostModel(cfg, hw, expert_format="q4_k_m", expert_blocks=q4km)
    assert (given.beta_s, given.cpu_startup_s, given.expert_bytes) == (named.beta_s, named.cpu_startup_s,
                                                                       named.expert_bytes)
    costs = format_costs(cfg, hw, "q4_k+q8_0", blocks=mix)
    assert CostModel(cfg, hw, expert_format="q4_k+q8_0", expert_blocks=mix).beta_s == pytest.approx(
        bf16.beta_s * costs.cpu_beta_scale)
    # a profile measured on Q8_0 experts: this model in Q8_0 gets the numbers back; in bf16 they are unscaled
    times = ExpertTimes(transfer_ms=2.0, cpu_beta_ms=0.3, cpu_startup_ms=0.5, expert_format="q8_0",
                        expert_mib=CostModel(cfg, hw, expert_format="q8_0").expert_bytes / 2**20)
    measured = dataclasses.replace(hw, measured={"m": times})
    q8 = CostModel(cfg, measured, "m", expert_format="q8_0")
    assert q8.beta_s == pytest.approx(0.3e-3) and q8.cpu_startup_s == pytest.approx(0.5e-3)
    assert q8.t_io == pytest.approx(2e-3)
    as_bf16 = CostModel(cfg, measured, "m")
    q8_rates = format_costs(cfg, hw, "q8_0")
    assert as_bf16.beta_s == pytest.approx(0.3e-3 / q8_rates.cpu_beta_scale)
    assert as_bf16.t_io == pytest.approx(2e-3 * as_bf16.expert_bytes / q8.expert_bytes)


# ---- the offloaded run of each source (slow: one compile per policy) --------------------------------------------


_CASES: dict[str, tuple] = {}


def _case(sources: dict[str, str], source: str) -> tuple:
    """(cfg, model, store, prompts, forced tokens, in-memory logits, envelope) of a source, built once per module."""
    from engine.fidelity import Deviation, float32_copy
    from models.generation import Generator

    if source not in _CASES:
        spec = ({"name": "q", "checkpoint": TINY, "expert_format": source} if source == "q8_0"
                else {"name": "q", "checkpoint": sources[source]})
        cfg, model, _ = load_model(spec, dtype="bfloat16")
        rs = np.random.RandomState(3)
        prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in rs.randint(4, 14, 8)]
        gen = Generator(model)
        forced = gen.generate(prompts, 16, pad_token_id=cfg.pad_token_id).tokens
        ref = gen.forced_logits(prompts, forced, cfg.pad_token_id)
        envelope = Deviation.between(ref, Generator(float32_copy(model)).forced_logits(prompts, forced,
                                                                                     cfg.pad_token_id))
        _CASES[source] = (cfg, model, ExpertStore.from_model(model), prompts, forced, ref, envelope)
    return _CASES[source]


def _policy_cases() -> list:
    """(source, policy) pairs: every source with every registered policy."""
    from tests.conftest import offload_policies

    kinds = [p if isinstance(p, str) else p.values[0] for p in offload_policies()]
    return [(source, kind) for source in ("gguf", "saved", "q8_0") for kind in kinds]


@pytest.mark.slow
@pytest.mark.parametrize("source,kind", _policy_cases())
def test_offloaded_quantized_sources_stay_within_their_envelope_for_every_policy(sources, source: str,
                                                                                 kind: str) -> None:
    """Every policy at no cache, a quarter and all experts: teacher-forced logits within the quantized in-memory
    model's own bf16 envelope (its distance from its float32 copy, same quantized experts), greedy agreement."""
    from tests.test_bf16 import every_budget_within_envelope

    cfg, model, store, prompts, forced, ref, envelope = _case(sources, source)
    assert envelope.max_abs > 0
    every_budget_within_envelope(kind, cfg, model, store, prompts, forced, ref, envelope, label=f"{source} ",
                                 expert_bytes=store.expert_bytes, **store.cost_format())


@pytest.mark.slow
@pytest.mark.parametrize("source", ["gguf", "saved"])
def test_engine_run_serves_a_quantized_file(sources, tmp_path: Path, source: str) -> None:
    """`python -m engine.run model.checkpoint=<quantized file>`: the in-memory tokens, the envelope, and the cost
    model in the file's format; without the comparison the store maps the file and nothing loads the experts."""
    from tests.test_generate_entry import run_entry

    common = [f"model.checkpoint={sources[source]}", "model.arch=null", "model.name=tiny-q", "workload.batch_size=2",
              "workload.num_batches=1", "workload.prompt_len=16", "workload.gen_len=4"]
    proc = run_entry("engine.run", f"hydra.run.dir={tmp_path / 'a'}", *common, "compare_in_memory=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "a" / "results.json").read_text())
    assert r["tokens_match_in_memory"] is True and r["fidelity"]["within_envelope"] is True
    assert r["cost_model_after"]["expert_format"] == ("q8_0" if source == "gguf" else "q4_k_m")
    assert r["cost_model_after"]["cpu_beta_scale"] != 1.0
    proc = run_entry("engine.run", f"hydra.run.dir={tmp_path / 'b'}", *common, "compare_in_memory=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r2 = json.loads((tmp_path / "b" / "results.json").read_text())
    assert r2["compared_in_memory"] is False and r2["expert_mib"] == r["expert_mib"]


@pytest.mark.slow
def test_calibrate_measures_quantized_experts(tmp_path: Path) -> None:
    """`engine.calibrate model.expert_format=q8_0`: transfers of the block bytes, the block kernel on the CPU and the
    dequantizing device expert; the profile says which format it measured, and a Q8_0 run takes its times as they are."""
    from conf import compose
    from models.loading import resolve_model_config
    from tests.test_calibrate import QUICK
    from tests.test_generate_entry import run_entry

    out = tmp_path / "q8.yaml"
    proc = run_entry("engine.calibrate", *QUICK, "model.expert_format=q8_0", f"out={out}",
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    raw = json.loads((tmp_path / "run" / "results.json").read_text())
    hw = load_hardware(str(out))
    times = hw.measured["mixtral-tiny"]
    cfg = resolve_model_config(compose("calibrate", ["model=mixtral_tiny"]).model)
    assert times.expert_format == raw["expert_format"] == "q8_0"
    assert times.expert_mib * 2**20 == pytest.approx(cfg.expert_bytes(4) * 8.5 / 32)  # Q8_0 of float32 experts
    cost = CostModel(cfg, hw, "mixtral-tiny", expert_format="q8_0", expert_bytes=round(times.expert_mib * 2**20))
    assert cost.beta_s == pytest.approx(times.cpu_beta_ms * 1e-3) and cost.t_io == pytest.approx(times.transfer_ms * 1e-3)
    assert cost.cpu_startup_s == pytest.approx(times.cpu_startup_ms * 1e-3)
