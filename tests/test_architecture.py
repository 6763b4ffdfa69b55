"""The dependency order of pyproject.toml's import-linter contract holds: imports point down only (entry points >
conf > engine > predictors | schedulers > models > core). A new import that runs back up fails here, naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_imports_point_down() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in proc.stdout


def test_serving_entry_points_do_not_load_torch() -> None:
    """torch is the CPU experts' fallback (no native library, block types the kernels do not read): importing the
    offload entry points must not load it (~0.12 GB of anonymous memory in every serving process, counted in the
    full-depth bound)."""
    code = ("import sys, engine.run, engine.offload.executor, engine.calibrate, models.generate; "
            "sys.exit(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3] or 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
