"""Orbax training checkpoints shared by `models.train` and `predictors.train`: one manager per folder of
numbered steps, and a resume that survives a damaged latest step.

A step is restored into the structure (shapes, dtypes, pytree) of a freshly initialised `target`, so a
resumed run continues with exactly the arrays it saved; numpy leaves come back as numpy arrays (float64
included), jax leaves as jax arrays.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


def checkpoint_manager(folder: Path, keep: int) -> ocp.CheckpointManager:
    """A manager of `folder` (created if missing) that keeps the newest `keep` steps."""
    return ocp.CheckpointManager(folder.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def run_checkpoints(folder: Path) -> Path:
    """The checkpoints of `folder`: a run folder's checkpoints/ if it has one, else the folder itself."""
    return folder / "checkpoints" if (folder / "checkpoints").is_dir() else folder


def saved_steps(folder: Path) -> list[int]:
    """The committed steps under `folder`, newest first ([] for a missing folder; nothing is created)."""
    if not folder.is_dir():
        return []
    mngr = checkpoint_manager(folder, keep=1000)
    try:
        return sorted((int(s) for s in mngr.all_steps()), reverse=True)
    finally:
        mngr.close()


def restore_latest(folder: Path, target: Any) -> tuple[int, Any]:
    """(step, tree) of the newest intact checkpoint under `folder`, restored into the structure of `target`.

    A step that cannot be restored (a file deleted, truncated or overwritten after the save) is skipped with a
    one-line warning naming it; the next older step is tried."""
    steps = saved_steps(folder)
    if not steps:
        raise FileNotFoundError(f"resume: no orbax checkpoint under {folder}")
    mngr = checkpoint_manager(folder, keep=1000)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    try:
        for step in steps:
            try:
                return step, mngr.restore(step, args=ocp.args.StandardRestore(abstract))
            except Exception as exc:  # orbax and tensorstore raise many types for a damaged step
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
                log.warning("resume: skipped damaged checkpoint step %d under %s (%s: %s)", step, folder,
                            type(exc).__name__, reason)
    finally:
        mngr.close()
    raise ValueError(f"resume: no intact checkpoint under {folder} (steps {steps} all damaged)")
