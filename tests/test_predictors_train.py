"""`python -m predictors.train` end to end on small synthetic traces: results.json, figures, orbax
predictor folders that `load_predictor` reads back, offline wandb files, and clear errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
from omegaconf import OmegaConf

from core.config import REPO_ROOT
from conf import compose
from predictors import load_predictor
from predictors.data import trace_context
from predictors.synthetic import shift_rule_trace

SMALL = ["predictor.train.epochs=2", "baselines.token.train.epochs=1", "baselines.moeless.moeless.max_epochs=1",
         "distances=[1,2]", "predictor.llapor.middle.width=32", "predictor.llapor.input.width=32"]


def _traces(tmp_path: Path) -> tuple[Path, Path]:
    """In-distribution (shift-by-1 rule) and shifted (shift-by-3) traces shaped like model=tiny_mixtral."""
    rng = np.random.default_rng(0)
    trace = shift_rule_trace(rng, hidden=64, n_seq=16, rows_per_seq=24, signal=1.0).save(tmp_path / "t.npz")
    shift = shift_rule_trace(rng, hidden=64, n_seq=6, rows_per_seq=24, shift=3, signal=1.0).save(tmp_path / "s.npz")
    return trace, shift


def test_entry_point_trains_evaluates_saves_and_logs_offline(tmp_path: Path) -> None:
    trace, shift = _traces(tmp_path)
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_SILENT": "true", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "predictors.train", "model=tiny_mixtral", f"trace={trace}",
                           f"shift_trace={shift}", "wandb.mode=offline", f"hydra.run.dir={run_dir}", *SMALL],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((run_dir / "results.json").read_text())
    assert res["data"]["test_rows"] == 4 * 24 and res["data"]["shift_rows"] == 6 * 24
    assert set(res["methods"]) == {"llapor", "stats", "gate@d1", "gate@d2", "token", "moeless@d1", "moeless@d2", "oracle"}
    groups = res["groups"]
    assert sorted(groups["input"] + groups["middle"] + groups["output"]) == [1, 2, 3]
    for name, m in res["methods"].items():
        for which in ("test", "shift"):
            assert set(m[which]["groups"]["all"]) == {"hit", "hot", "coverage", "pearson", "pearson_step", "load_acc"}
    assert res["methods"]["oracle"]["test"]["groups"]["all"]["hit"] == 1.0
    assert sorted(res["methods"]["gate@d2"]["test"]["layers"]) == ["2", "3"]
    assert set(res["online"]) == {"test", "shift"} and "cycles" in res["online"]["shift"]
    assert {"headline_ge_gate_and_stats_hit", "headline_shift_drop_hit", "moeless_ge_gate_load_acc"} <= set(res["targets"])
    for png in ("accuracy_per_layer.png", "moeless_distance.png", "load_correlation.png", "online.png"):
        assert (run_dir / png).stat().st_size > 1000 and png in res["plots"]
    assert list((run_dir / "wandb").glob("offline-run-*"))
    assert "predictor accuracy" in proc.stdout
    # every saved predictor loads back by config and forecasts the target layers
    from core.trace import load_trace

    t = load_trace(trace)
    ctx = trace_context(t, 0, np.arange(10))
    for key in ("llapor", "stats", "token", "gate@d1", "moeless@d2"):
        m = res["methods"][key]
        pred = load_predictor({"name": key, "kind": m["kind"], "distance": m["distance"], "checkpoint": m["checkpoint"]})
        assert pred.predict(ctx).shape == (10, 8) and max(m["memory_mb"].values()) > 0


def test_mismatched_trace_fails_naming_the_key(tmp_path: Path) -> None:
    from core.telemetry import Telemetry
    from predictors.train import run

    bad = shift_rule_trace(np.random.default_rng(1), num_experts=16, hidden=64).save(tmp_path / "bad.npz")
    node = compose("predictors_train", ["model=tiny_mixtral", f"trace={bad}", "shift=false", "wandb.mode=disabled"])
    with Telemetry(node, task="predictors_train", run_dir=tmp_path / "run") as tm:
        with pytest.raises(ValueError, match=r"trace=.*bad.npz.*16 experts"):
            run(OmegaConf.to_object(node), tm)
    assert not (tmp_path / "run" / "results.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mixtral_tiny", "deepseek_tiny"])
def test_shipped_model_llapor_beats_stats_and_gate_and_moeless_beats_gate(model: str, tmp_path: Path) -> None:
    """The real pipeline on a trained checkpoint: record both workloads, train, evaluate (minutes each).

    LLaPor keeps its configured 30 epochs: on deepseek_tiny's 32 experts with these 48 sequences, 10
    epochs (~170 AdamW steps) leave it below the raw gate (0.817 vs 0.856 top-4 hit rate)."""
    from core.telemetry import Telemetry
    from predictors.train import run

    node = compose("predictors_train", [f"model={model}", "workload.num_batches=6", "shift_workload.num_batches=2",
                                        "baselines.token.train.epochs=5",
                                        "distances=[1,2]", "plots=false", "wandb.mode=disabled"])
    with Telemetry(node, task="predictors_train", run_dir=tmp_path) as tm:
        res = run(OmegaConf.to_object(node), tm)
    hit = {name: m["test"]["groups"]["all"]["hit"] for name, m in res["methods"].items()}
    assert hit["llapor"] > hit["stats"] + 0.1 and hit["llapor"] > hit["gate@d1"]
    assert all(v["met"] for v in res["targets"]["moeless_ge_gate_load_acc"].values())
    assert (tmp_path / "trace.npz").is_file() and (tmp_path / "shift_trace.npz").is_file()


# ---- mid-training checkpoints and resume ------------------------------------------------------------------------
# LLaPor (3 target layers x 6 epochs, one group: one compilation) and MoEless at d=1 (3 fine-tuned layers x 4
# epochs: its threshold cannot be reached), a checkpoint every 2 epochs; no evaluation extras.
RESUME = ["model=tiny_mixtral", "shift=false", "online=false", "plots=false", "wandb.mode=disabled", "distances=[1]",
          "~predictor@baselines.stats", "~predictor@baselines.gate", "~predictor@baselines.token",
          "~predictor@baselines.oracle", "predictor.train.epochs=6", "predictor.llapor.groups.mode=manual",
          "predictor.llapor.groups.input=[1,2,3]", "predictor.llapor.input.width=16", "predictor.llapor.input.blocks=1",
          "baselines.moeless.moeless.max_epochs=4", "baselines.moeless.moeless.threshold=1.01", "checkpoint_every=2"]
LLAPOR_EPOCHS, MOELESS_EPOCHS, LAYERS = 6, 4, 3


class Interrupted(Exception):
    """Stands in for a crash or a kill in the middle of training."""


def count_epochs(monkeypatch: pytest.MonkeyPatch, crash_after: Optional[int] = None) -> list[int]:
    """Count the compiled training epochs `fit` runs; with `crash_after`, the next one raises `Interrupted`."""
    from predictors import fitting

    ran: list[int] = []
    cached = getattr(fitting._cached, "unpatched", fitting._cached)  # not a counter installed earlier in the test

    def counting(key: Any, build: Any) -> Any:
        fn = cached(key, build)
        if key is None or key[0] != "epoch":
            return fn

        def epoch(*args: Any) -> Any:
            if crash_after is not None and len(ran) >= crash_after:
                raise Interrupted
            ran.append(1)
            return fn(*args)

        return epoch

    counting.unpatched = cached  # type: ignore[attr-defined]
    monkeypatch.setattr(fitting, "_cached", counting)
    return ran


def train_predictors(run_dir: Path, trace: Path, *overrides: str) -> dict[str, Any]:
    from core.telemetry import Telemetry
    from predictors.train import run

    node = compose("predictors_train", [*RESUME, f"trace={trace}", *overrides])
    with Telemetry(node, task="predictors_train", run_dir=run_dir) as tm:
        return run(OmegaConf.to_object(node), tm)


def saved_arrays(res: dict[str, Any]) -> dict[str, Any]:
    from predictors.checkpoint import load_arrays

    return {key: load_arrays(res["methods"][key]["checkpoint"]) for key in ("llapor", "moeless@d1")}


def assert_same_arrays(a: Any, b: Any) -> None:
    import jax

    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # bit-exact: CPU, same compiled epochs


def test_interrupted_training_resumes_to_the_same_predictors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace, _ = _traces(tmp_path)
    ran = count_epochs(monkeypatch)
    full = train_predictors(tmp_path / "full", trace)
    assert len(ran) == LAYERS * (LLAPOR_EPOCHS + MOELESS_EPOCHS)
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints" / "llapor" / "layer1").iterdir()) == ["4", "6"]

    # killed in LLaPor's second layer after its 5th epoch: the checkpoint of epoch 4 is the newest
    count_epochs(monkeypatch, crash_after=LLAPOR_EPOCHS + 5)
    with pytest.raises(Interrupted):
        train_predictors(tmp_path / "cut", trace)
    # the same run folder again (a fixed hydra.run.dir): layer 1 is restored, layer 2 redoes epochs 5-6
    ran = count_epochs(monkeypatch)
    resumed = train_predictors(tmp_path / "cut", trace, "resume=true")
    assert len(ran) == 2 + LLAPOR_EPOCHS + LAYERS * MOELESS_EPOCHS
    assert resumed["resumed_from"] == str(tmp_path / "cut" / "checkpoints")
    assert_same_arrays(saved_arrays(resumed), saved_arrays(full))
    assert resumed["methods"]["llapor"]["final_loss"] == full["methods"]["llapor"]["final_loss"]
    assert resumed["methods"]["moeless@d1"]["profile"] == full["methods"]["moeless@d1"]["profile"]


def test_damaged_latest_step_falls_back_to_the_newest_intact_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    trace, _ = _traces(tmp_path)
    first = train_predictors(tmp_path / "a", trace)
    # overwrite the data files of LLaPor's last layer's final step with zeros, as a bad disk or a torn copy would
    step6 = tmp_path / "a" / "checkpoints" / "llapor" / "layer3" / "6"
    data = [p for p in step6.rglob("*") if p.is_file() and "ocdbt" in str(p) and p.stat().st_size > 0]
    assert data
    for f in data:
        f.write_bytes(b"\0" * f.stat().st_size)

    ran = count_epochs(monkeypatch)
    with caplog.at_level("WARNING"):
        second = train_predictors(tmp_path / "b", trace, f"resume={tmp_path / 'a'}")
    skipped = [r.getMessage() for r in caplog.records if "skipped damaged checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and "\n" not in skipped[0]
    assert skipped[0].startswith(f"resume: skipped damaged checkpoint step 6 under {step6.parent} (")
    assert len(ran) == LLAPOR_EPOCHS - 4  # only layer 3's epochs 5-6; everything else restored whole
    assert_same_arrays(saved_arrays(second), saved_arrays(first))
    # the new run is resumable on its own: every layer's checkpoints were carried over or written
    for layer in (1, 2, 3):
        assert (tmp_path / "b" / "checkpoints" / "llapor" / f"layer{layer}" / "6").is_dir()


@pytest.mark.parametrize("resume", ["folder", "true"])
def test_resume_without_checkpoints_fails_naming_the_folder(tmp_path: Path, resume: str) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    value = str(empty) if resume == "folder" else "true"
    where = empty if resume == "folder" else tmp_path / "run" / "checkpoints"
    message = f"resume={value}: no predictor training checkpoint under {where} "
    with pytest.raises(FileNotFoundError, match="^" + re.escape(message)):
        train_predictors(tmp_path / "run", tmp_path / "never_read.npz", f"resume={value}")


def test_resume_trains_on_the_interrupted_runs_recorded_traces(tmp_path: Path) -> None:
    from predictors.fitting import Checkpoints
    from predictors.train import resumed_trace

    old = tmp_path / "old"
    (old / "checkpoints").mkdir(parents=True)
    (old / "trace.npz").write_bytes(b"")
    ckpt = Checkpoints(folder=tmp_path / "new" / "checkpoints", every=2, resume=old / "checkpoints")
    assert resumed_trace(ckpt, "trace.npz") == str(old / "trace.npz")
    assert resumed_trace(ckpt, "shift_trace.npz") is None  # not saved: recorded again
    assert resumed_trace(Checkpoints(folder=ckpt.folder, every=2), "trace.npz") is None
