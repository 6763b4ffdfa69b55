"""`python -m models.generate` as a user runs it: Hydra overrides, results.json, wandb offline files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_entry(module: str, *overrides: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_SILENT": "true", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", module, *overrides], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_generate_writes_results_and_offline_wandb(tmp_path: Path) -> None:
    proc = run_entry("models.generate", f"hydra.run.dir={tmp_path}", "batch_size=2", "prompt_len=8",
                     "max_new_tokens=5", "model=tiny_deepseek_v2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["family"] == "deepseek_v2" and results["batch_size"] == 2
    assert results["generated_tokens"] == 10 and results["decode_tokens_per_s"] > 0
    assert len(results["generated_ids"]) == 2 and all(len(s) == 5 for s in results["generated_ids"])
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline wandb run written"
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
    assert "decode_tokens_per_s" in proc.stdout


def test_generate_rejects_a_bad_override_by_name(tmp_path: Path) -> None:
    proc = run_entry("models.generate", f"hydra.run.dir={tmp_path}", "max_new_tokens=lots")
    assert proc.returncode != 0
    assert "max_new_tokens" in proc.stderr
    assert not (tmp_path / "results.json").exists()
