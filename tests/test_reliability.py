"""What a hostile but fair user hits: runs started together, hardware profiles that say nonsense, user errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from schedulers.hardware import load_hardware

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model=deepseek_v2_lite", "batch_size=2", "prompt_len=16", "gen_len=3", "timeline.max_layers=4",
         "wandb.mode=disabled"]  # wandb is not what these tests check


def simulate(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine.simulate", *SMALL, *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})


def test_runs_started_together_get_a_folder_each(tmp_path: Path) -> None:
    procs = {kind: simulate(f"scheduler={kind}", cwd=tmp_path) for kind in ("fiddler", "ondemand", "klotski")}
    for kind, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    folders = sorted(p.parent for p in (tmp_path / "runs" / "simulate").glob("*/results.json"))
    assert len(folders) == 3
    labels = {json.loads((f / "results.json").read_text())["scheduler_kind"] for f in folders}
    assert labels == set(procs)
    for f in folders:
        assert (f / ".hydra" / "config.yaml").is_file() and (f / "timeline.png").stat().st_size > 1000
        overrides = (f / ".hydra" / "overrides.yaml").read_text()
        kind = json.loads((f / "results.json").read_text())["scheduler_kind"]
        assert f"scheduler={kind}" in overrides


def _profile(tmp_path: Path, drop: str = "", **sets: str) -> Path:
    """v100_pcie3.yaml with one key removed and some values replaced (dotted keys, `__` for `.`)."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(REPO / "conf" / "hardware" / "v100_pcie3.yaml")
    if drop:
        block, _, key = drop.rpartition(".")
        (node[block] if block else node).pop(key)
    for key, value in sets.items():
        OmegaConf.update(node, key.replace("__", "."), value)
    path = tmp_path / "profile.yaml"
    OmegaConf.save(node, path)
    return path


@pytest.mark.parametrize("drop", ["host_link.peak_gbps", "name", "cpu.memory_gbps"])
def test_a_profile_must_state_what_no_default_fits(tmp_path: Path, drop: str) -> None:
    path = _profile(tmp_path, drop=drop)
    with pytest.raises(ValueError, match=f"{path}: {drop} is required"):
        load_hardware(str(path))


@pytest.mark.parametrize("key, value", [("gpu__reserved_gib", -100), ("cpu__expert_overhead_us", -5),
                                        ("host_link__latency_us", -1), ("cpu__memory_efficiency", 1.5),
                                        ("interconnect__gbps_per_device", -3), ("gpu__hbm_gbps", float("nan"))])
def test_a_meaningless_number_is_refused_naming_file_and_key(tmp_path: Path, key: str, value: float) -> None:
    path = _profile(tmp_path, **{key: value})
    with pytest.raises(ValueError, match=f"{path}: .*{key.replace('__', '.')}"):
        load_hardware(str(path))


def test_a_user_error_is_one_line_and_the_traceback_stays_available(tmp_path: Path) -> None:
    proc = simulate(f"hydra.run.dir={tmp_path}", "hardware.gpu.reserved_gib=-100")
    _, err = proc.communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in err
    assert len(lines) == 1 and "gpu.reserved_gib" in lines[0] and "v100_pcie3.yaml" in lines[0], err
    proc = simulate(f"hydra.run.dir={tmp_path}", "hardware.gpu.reserved_gib=-100", env={"HYDRA_FULL_ERROR": "1"})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "Traceback" in err and "gpu.reserved_gib" in err


def test_results_name_the_defaults_a_profile_took(tmp_path: Path) -> None:
    proc = simulate(f"hydra.run.dir={tmp_path}", "timeline.plot=false", "hardware.gpu.call_overhead_us=3")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    defaults = json.loads((tmp_path / "results.json").read_text())["hardware_defaults"]
    assert defaults["gpu.layer_overhead_us"] == 0.0 and defaults["cpu.dispatch_us"] == 0.0
    assert "gpu.call_overhead_us" not in defaults and "host_link.peak_gbps" not in defaults


def _nan_checkpoint(tmp_path: Path) -> Path:
    """The shipped mixtral-tiny with one NaN in layer 1's attention output projection, saved in bf16."""
    import jax.numpy as jnp

    from core.config import resolve_path
    from models.hf import load_hf, save_hf

    src = resolve_path("pkg:models/checkpoints/mixtral-tiny")
    cfg, model = load_hf(src, dtype=jnp.float32)
    w = model.layers[1].attn.o.weight
    w[...] = w[...].at[0, 0].set(jnp.nan)
    folder = tmp_path / "nan-ckpt"
    save_hf(cfg, model, folder, dtype=jnp.bfloat16)
    for extra in src.glob("tokenizer*"):
        (folder / extra.name).write_bytes(extra.read_bytes())
    return folder


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    from models.hf import CheckpointError, open_checkpoint
    from models.loading import check_weights, load_model

    folder = _nan_checkpoint(tmp_path)
    spec = {"name": "nan", "checkpoint": str(folder)}
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.1\.self_attn\.o_proj\.weight has 1 NaN/Inf"):
        load_model(spec, dtype="auto")
    load_model({**spec, "allow_nonfinite": True}, dtype="auto")  # the override serves it
    opened = open_checkpoint(folder)
    with pytest.raises(CheckpointError):
        check_weights(spec, opened)
    proc = subprocess.run([sys.executable, "-m", "engine.run", f"hydra.run.dir={tmp_path / 'run'}",
                           f"model.checkpoint={folder}", "model.arch=null", "model.name=nan", "workload.batch_size=2",
                           "workload.num_batches=1", "workload.gen_len=2", "wandb.mode=disabled"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "o_proj.weight has 1 NaN/Inf values" in proc.stderr.strip().splitlines()[-1]


def test_non_finite_expert_weight_is_named_when_loading_in_memory(tmp_path: Path) -> None:
    """The in-memory load scans each stacked expert array as it is copied; a NaN in one expert's tensor is
    reported under that stored tensor's name, not the stacked parameter's."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from core.config import resolve_path
    from models.hf import CheckpointError
    from models.loading import load_model

    src = resolve_path("pkg:models/checkpoints/mixtral-tiny")
    folder = tmp_path / "nan-expert"
    shutil.copytree(src, folder)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    tensors[name][3, 5] = torch.inf
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {name.replace('.', chr(92) + '.')} has 1 NaN/Inf"):
        load_model({"name": "nan", "checkpoint": str(folder)}, dtype="auto")


def _small_trace():
    from core.trace import RoutingTrace, TraceMeta, TraceRecorder

    rec = TraceRecorder(TraceMeta(model="t", family="mixtral", num_experts=4, top_k=2, moe_layers=(0, 1)))
    experts = [np.array([[0, 1], [2, 3]]), np.array([[1, 2], [0, 3]])]
    weights = [np.full((2, 2), 0.5, np.float32)] * 2
    rec.add_step(experts, weights, seq=np.arange(2), pos=np.zeros(2, np.int64), phase=0)
    trace = rec.build()
    assert isinstance(trace, RoutingTrace)
    return trace


def test_damaged_traces_are_named(tmp_path: Path) -> None:
    import zipfile

    from core.trace import RoutingTrace, TraceFormatError
    from core.trace_import import import_vllm_jsonl

    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    with pytest.raises(TraceFormatError, match=f"{empty}: not a .npz trace"):
        RoutingTrace.load(empty)
    good = _small_trace().save(tmp_path / "good.npz")
    damaged = tmp_path / "damaged.npz"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(damaged, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, data[:len(data) // 2] if info.filename == "weights.npy" else data)
    with pytest.raises(TraceFormatError, match=f"{damaged}: array 'weights' is damaged"):
        RoutingTrace.load(damaged)
    negative = _small_trace()
    negative.weights[1, 0, 1] = -0.5
    negative.save(tmp_path / "negative.npz")
    with pytest.raises(TraceFormatError, match=r"array 'weights': routing weights must be finite and >= 0; found -0.5 "
                                               r"at \(layer 1, row 0, slot 1\)"):
        RoutingTrace.load(tmp_path / "negative.npz")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"type": "meta", "num_experts": 4}\n{"request_id": "caf\xe9"}\n')
    with pytest.raises(TraceFormatError, match=f"{latin}:2: not UTF-8 text"):
        import_vllm_jsonl(latin)


def test_a_batch_larger_than_the_workload_is_an_error() -> None:
    from core.texts import TextPrompt
    from engine.workloads.prompts import PromptSampler

    class Chars:
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    prompts = [TextPrompt(str(i), f"prompt number {i}") for i in range(3)]
    with pytest.raises(ValueError, match="workload.batch_size: 4 exceeds the workload's 3 prompts"):
        PromptSampler(prompts, Chars(), batch_size=4, prompt_len=8, gen_len=2)
    sampler = PromptSampler(prompts, Chars(), batch_size=3, prompt_len=8, gen_len=2)
    ids = [b.prompt_ids for b in sampler.batches(2)]  # the second batch starts a logged second epoch
    assert all(len(set(i)) == 3 for i in ids)
