"""`python -m engine.calibrate` end to end: it measures this machine and writes a profile the schema loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conf import compose
from schedulers.hardware import load_hardware
from models.loading import resolve_model_config
from schedulers.cost import CostModel
from tests.test_generate_entry import run_entry

QUICK = ["model=mixtral_tiny", "repeats=1", "token_counts=[1,8]", "batch=2", "prompt_len=8", "new_tokens=3",
         "wandb.mode=disabled"]


def test_calibrate_writes_a_loadable_profile_and_keeps_other_models(tmp_path: Path) -> None:
    out = tmp_path / "here.yaml"
    other = {"transfer_ms": 9.0, "gpu_ms": 1.0, "cpu_beta_ms": 0.5, "cpu_startup_ms": 0.25}
    out.write_text(yaml.safe_dump({"measured": {"some-other-model": other}}))
    proc = run_entry("engine.calibrate", *QUICK, f"out={out}", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    raw = json.loads((tmp_path / "run" / "results.json").read_text())
    assert raw["profile"] == str(out)

    hw = load_hardware(str(out))  # validated by the schema on load
    assert hw.gpu.host_cpu_share == 1.0 and hw.host_link.host_cpu_share == 1.0  # the CPU backend: all on the host
    assert hw.measured["some-other-model"].transfer_ms == 9.0  # earlier entries of other models stay
    tiny = hw.measured["mixtral-tiny"]
    assert tiny.transfer_ms == raw["t_io_ms"] and tiny.cpu_beta_ms == raw["cpu_beta_ms"]
    assert tiny.transfer_ms > 0 and tiny.gpu_ms > 0 and tiny.cpu_startup_ms >= 0
    # the cost model of that model prefers the measured times to its roofline
    cfg = resolve_model_config(compose("calibrate", ["model=mixtral_tiny"]).model)
    cost = CostModel(cfg, hw, "mixtral-tiny", bytes_per_param=4)
    assert cost.t_io == tiny.transfer_ms * 1e-3 and cost.device_cpu_share == 1.0
    assert cost.t_c(8) == pytest.approx((tiny.cpu_beta_ms * 8 + tiny.cpu_startup_ms) * 1e-3)
    # eq. 2's fit over 1 and 8 tokens: a one-token expert costs less than a millisecond on any machine
    # (an unwarmed first call, torch's set-up, would have put ~2 ms into C)
    assert 0 < cost.t_c(1) < 1e-3


def test_calibrate_names_a_bad_key(tmp_path: Path) -> None:
    proc = run_entry("engine.calibrate", *QUICK, "repeat=3", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0 and "repeat" in proc.stderr

