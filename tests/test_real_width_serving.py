"""Real widths, not only tiny ones: bf16 checkpoints at the released models' hidden and expert sizes
(Qwen3-30B-A3B 2048 x 768, DeepSeek-V2-Lite 2048 x 1408 with MLA and shared experts, Mixtral-8x7B
4096 x 14336), cut in depth and expert count, served the way a user serves them.

- loading copies each tensor once from the mapped files: the in-memory model adds about its own
  bytes of anonymous memory, the offloaded run's expert store adds none (views of the files);
- the offloaded bf16 run stays within bf16's own distance from float32 of the in-memory model;
- a bf16 CPU expert at Mixtral's width matches a float64 reference;
- bad checkpoints fail before any heavy work: a quantized (FP8) tensor, a shard missing from the
  index, a checkpoint larger than the machine's memory (a sparse file).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from schedulers.hardware import load_hardware
from engine.bench.real_width import real_width_config, write_random_checkpoint
from engine.fidelity import Deviation, float32_copy, offloaded_forced_logits
from engine.offload.cpu_experts import CpuExperts
from engine.offload.executor import OffloadExecutor, OffloadSettings
from engine.offload.store import ExpertStore
from models.generation import Generator
from models.hf import CheckpointError, load_hf, open_checkpoint
from models.memory import anon_bytes
from predictors.gate import GatePredictor
from schedulers.base import SchedulerSetup, build_scheduler
from schedulers.offload.presched import PreSchedSettings
from schedulers.cost import CostModel
from tests.test_generate_entry import run_entry

SMALL = dict(vocab_size=4096, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module", params=[("qwen3_moe", 2, "per_expert", 8), ("deepseek_v2", 3, "fused", 8),
                                        # two experts per token: the offloaded run must equal the in-memory one
                                        pytest.param(("mixtral", 2, "per_expert", 4), marks=pytest.mark.slow)],
                ids=lambda p: p[0])
def checkpoint(request, tmp_path_factory) -> Path:
    family, layers, layout, experts = request.param
    cfg = real_width_config(family, layers, num_experts=experts, **SMALL)
    return write_random_checkpoint(cfg, tmp_path_factory.mktemp(family) / "ckpt", layout=layout, shards=3)


def test_loading_copies_each_tensor_once_and_the_store_views_the_files(checkpoint: Path) -> None:
    opened = open_checkpoint(checkpoint)
    assert opened.stored_dtype() == ml_dtypes.bfloat16
    before = anon_bytes()
    _, model = load_hf(checkpoint, dtype="bfloat16", opened=opened)
    grown = anon_bytes() - before
    params = opened.param_bytes(ml_dtypes.bfloat16)
    assert params <= opened.file_bytes
    assert grown <= 1.15 * params, f"loading {params / 2**20:.0f} MiB of parameters took {grown / 2**20:.0f} MiB"
    assert model.embed[...].dtype == ml_dtypes.bfloat16
    store = ExpertStore.from_checkpoint(opened)
    assert store.dtype == ml_dtypes.bfloat16 and store.allocated_bytes == 0
    gate, up, down = store.numpy_views(0, 3)
    assert not gate.flags.writeable  # the mapped file itself, read-only
    F, H = opened.cfg.expert_intermediate_size, opened.cfg.hidden_size
    assert gate.shape == up.shape == (F, H) and down.shape == (H, F)
    layer = opened.cfg.moe_layers[0]
    gu = np.asarray(model.layers[layer].moe.experts.gate_up[3][...])
    np.testing.assert_array_equal(np.concatenate([gate, up]).view(np.uint16), gu.view(np.uint16))


def test_offloaded_bf16_at_real_width_is_within_the_envelope(checkpoint: Path) -> None:
    cfg, model = load_hf(checkpoint, dtype="bfloat16")
    store = ExpertStore.from_checkpoint(checkpoint)
    rs = np.random.RandomState(1)
    prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in (5, 9, 3, 7)]
    gen = Generator(model)
    forced = gen.generate(prompts, 8, pad_token_id=0).tokens
    ref = gen.forced_logits(prompts, forced, 0)
    envelope = Deviation.between(ref, Generator(float32_copy(model)).forced_logits(prompts, forced, 0))
    L, E = len(cfg.moe_layers), cfg.num_experts
    cost = CostModel(cfg, load_hardware("local_cpu"), bytes_per_param=2)
    sched = build_scheduler(PreSchedSettings(label="presched"),
                            SchedulerSetup(L, E, cfg.num_experts_per_tok, L * E // 4, cost, np.ones((L, E), np.int64)))
    predictors = {1: GatePredictor.from_model(model, 1)} if L > 1 else {}
    with OffloadExecutor(model, store, sched, cost, OffloadSettings(cache_slots=L * E // 4), predictors) as ex:
        got = offloaded_forced_logits(ex, prompts, forced, 0)
        assert ex.cache.gate_up[0].dtype == ml_dtypes.bfloat16  # the device cache keeps bf16 too
    dev = Deviation.between(got, ref)
    assert envelope.max_abs > 0
    assert dev.max_abs <= envelope.max_abs and dev.mean_abs <= envelope.mean_abs, (dev, envelope)
    assert dev.argmax_agreement >= 0.95, (dev, envelope)  # 32 positions: one flip is 3 %


def test_a_mixtral_width_cpu_expert_matches_float64() -> None:
    cfg = real_width_config("mixtral", 1, num_experts=1, **SMALL)
    F, H = cfg.expert_intermediate_size, cfg.hidden_size
    assert (H, F) == (4096, 14336)
    rng = np.random.default_rng(0)
    weights = [(0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)
               for shape in ((F, H), (F, H), (H, F))]
    store = ExpertStore(cfg, ml_dtypes.bfloat16)
    store.put(0, 0, *weights)
    x = rng.standard_normal((3, H), np.float32).astype(ml_dtypes.bfloat16)
    cpu = CpuExperts(store)
    try:
        got = cpu.compute(0, x, np.zeros((3, 1), np.int64), np.array([[0.5], [1.0], [2.0]], np.float32), [0])
    finally:
        cpu.close()
    gate, up, down = (w.astype(np.float64) for w in weights)
    xs = x.astype(np.float64)
    a, b = xs @ gate.T, xs @ up.T
    want = ((a / (1 + np.exp(-a)) * b) @ down.T) * np.array([[0.5], [1.0], [2.0]])
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 2e-2 * scale  # bf16 rounding of the projections, f32 accumulation


def _sparse_checkpoint(folder: Path, hidden: int, inter: int, experts: int, layers: int,
                       dtypes: dict[str, str] | None = None) -> Path:
    """A bf16 Mixtral checkpoint whose headers claim every tensor but whose data is a hole in a sparse file
    (`dtypes` overrides the stored dtype of some tensors)."""
    from engine.bench.real_width import hf_config_dict, tensor_specs

    cfg = real_width_config("mixtral", layers, num_experts=experts, hidden_size=hidden, intermediate_size=inter, **SMALL)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    header, offset = {}, 0
    for spec in tensor_specs(cfg, "per_expert"):
        n = int(np.prod(spec.shape)) * 2
        dtype = (dtypes or {}).get(spec.name, "BF16")
        header[spec.name] = {"dtype": dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)  # a hole: no disk used, nothing to read
    return folder


def test_a_checkpoint_larger_than_memory_fails_before_loading(tmp_path: Path) -> None:
    from models.memory import host_memory

    total = host_memory()[0]
    if total is None:
        pytest.skip("no /proc/meminfo")
    # experts of 2 x 8192 x 28672 bf16 (1.3 GiB each): enough of them to pass the machine's memory
    experts = int(total // (3 * 8192 * 28672 * 2)) + 2
    folder = _sparse_checkpoint(tmp_path / "huge", 8192, 28672, experts, 1)
    gen = run_entry("models.generate", f"hydra.run.dir={tmp_path / 'g'}", f"model.checkpoint={folder}",
                    "model.arch=null", "model.name=huge", "batch_size=1", "prompt_len=4", "max_new_tokens=2")
    assert gen.returncode != 0 and "needs" in gen.stderr and "GiB of host memory" in gen.stderr, gen.stderr[-2000:]
    run = run_entry("engine.run", f"hydra.run.dir={tmp_path / 'r'}", f"model.checkpoint={folder}", "model.arch=null",
                    "model.name=huge", "compare_in_memory=false")
    assert run.returncode != 0 and "routed experts take" in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "g" / "results.json").exists() and not (tmp_path / "r" / "results.json").exists()


def test_quantized_tensors_and_missing_shards_are_named(tmp_path: Path) -> None:
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    folder = _sparse_checkpoint(tmp_path / "fp8", 64, 128, 2, 1, dtypes={name: "F8_E4M3"})
    with pytest.raises(CheckpointError, match=r"experts\.1\.w2\.weight is stored as F8_E4M3.*dequantize"):
        open_checkpoint(folder)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: shard named in the index is missing"):
        open_checkpoint(folder)


def test_defaults_derive_from_a_deep_models_depth_and_size() -> None:
    """What the main job derives for a DeepSeek-V3-sized model (60 MoE layers of 256 experts of 42 MiB, 640 GiB of
    experts): distances up to 3 layers ahead and a budget capped by the device, not a quarter of the experts."""
    import dataclasses

    from core.config import to_frozen
    from conf import compose
    from engine.offload.settings import OffloadSettings
    from engine.calibrate import device_memory_gib
    from engine.run import cache_slots, default_distances
    from models.config import ModelConfig

    arch = to_frozen(compose("generate", ["model=tiny_mixtral"]).model.arch, ModelConfig)
    deep = dataclasses.replace(arch, num_hidden_layers=60, num_experts=256, num_experts_per_tok=8)
    assert default_distances(len(deep.moe_layers)) == [1, 2, 3] and default_distances(2) == [1]
    expert = 3 * 7168 * 2048 * 2
    dense = 30 * 2**30
    slots = cache_slots(deep, OffloadSettings(), expert, dense_bytes=dense)
    room = max(device_memory_gib() * 2**30 - dense, 0) / 2
    assert slots * expert <= room and slots < 0.25 * 60 * 256


@pytest.mark.parametrize("layers", [2, pytest.param(60, marks=pytest.mark.slow)])
def test_the_main_job_fits_a_shallow_and_a_deep_model_with_no_override(tmp_path: Path, layers: int) -> None:
    """Forecast distances, the expert budget and the in-memory comparison derive from the model: a 2-layer and
    a 60-layer checkpoint (bf16, tiny widths) run with the checkpoint as the only model setting."""
    import dataclasses

    from core.config import to_frozen
    from conf import compose
    from models.config import ModelConfig

    arch = to_frozen(compose("generate", ["model=tiny_mixtral"]).model.arch, ModelConfig)
    cfg = dataclasses.replace(arch, num_hidden_layers=layers, vocab_size=4096, bos_token_id=1, eos_token_id=2)
    folder = write_random_checkpoint(cfg, tmp_path / "ckpt", shards=2)
    proc = run_entry("engine.run", f"hydra.run.dir={tmp_path / 'run'}", f"model.checkpoint={folder}", "model.arch=null",
                     "model.name=deep", "workload.batch_size=2", "workload.num_batches=1", "workload.prompt_len=16",
                     "workload.gen_len=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    assert r["dtype"] == "bfloat16" and r["predictor_distances"] == [d for d in (1, 2, 3) if d < layers]
    assert r["cache_slots"] == round(0.25 * layers * cfg.num_experts) - 2  # a quarter, staging buffers included
    assert r["compared_in_memory"] and r["tokens_match_in_memory"] is not None
    assert r["fidelity"]["within_envelope"] is True
    assert r["load_s"] > 0 and r["peak_anon_bytes"] > 0 and r["checkpoint_bytes"] > 0
