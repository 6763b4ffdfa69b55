"""Telemetry shared by every entry point: results.json, a rich summary, progress bars, wandb.

    with Telemetry(cfg, task="simulate") as tm:
        for step in tm.progress(range(n), "decode"):
            tm.log({"latency_ms": ...}, step=step)
        tm.write_results(results)
        tm.summary("simulate", results)
"""

from __future__ import annotations

import enum
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, List, Mapping, Optional, TypeVar

import numpy as np
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

T = TypeVar("T")
console = Console(stderr=False)


def hydra_run_dir() -> Optional[Path]:
    """The current Hydra job's output folder, or None outside a Hydra app."""
    try:
        from hydra.core.hydra_config import HydraConfig  # hydra: core stays importable outside a Hydra app

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):
        pass
    return None


JOB_COMPLETE = "job_complete.json"  # a multirun job's marker: results.json is whole (what resume skips on)
WANDB_RUN = "wandb.json"  # where a run's wandb run went (project, group, mode): the report's summary run joins it


def multirun_job() -> Optional[tuple[Path, list[str]]]:
    """(the job's folder, its overrides) when this process runs a job of a Hydra multirun, whichever launcher
    started it; None otherwise."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized():
            hc = HydraConfig.get()
            if hc.mode == RunMode.MULTIRUN:
                return Path(hc.runtime.output_dir), list(hc.overrides.task)
    except (ImportError, ValueError):
        pass
    return None


def completed_results(job_dir: Path, overrides: list[str]) -> Optional[dict[str, Any]]:
    """The results of a multirun job already done in `job_dir` with the same `overrides` (a rerun of the same
    multirun resumes: a finished job is not redone); None when it has to run."""
    marker, results = job_dir / JOB_COMPLETE, job_dir / "results.json"
    if not (marker.is_file() and results.is_file()):
        return None
    try:
        done = json.loads(marker.read_text())
        if done.get("overrides") != overrides:
            return None  # the folder holds another sweep's job: run this one over it
        return json.loads(results.read_text())
    except (json.JSONDecodeError, OSError):
        return None  # an unreadable marker or results: run again


def mark_complete(job_dir: Path, overrides: list[str], started: float) -> None:
    """Record that the job with `overrides` finished its results.json in `job_dir` (written last, atomically)."""
    import time

    atomic_write_text(job_dir / JOB_COMPLETE, json.dumps({"overrides": overrides, "started": started,
                                                          "finished": time.time()}) + "\n")


def to_jsonable(value: Any) -> Any:
    """Convert numpy / jax scalars and arrays, enums, paths and tuples to JSON types."""
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if hasattr(value, "__array__") and not isinstance(value, (str, bytes)):
        return to_jsonable(np.asarray(value).tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "name") and hasattr(value, "value") and value.__class__.__module__ != "builtins":
        return value.name  # enums
    return value


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file, so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; the file should read like any other
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def results_text(results: Mapping[str, Any]) -> str:
    """`results` as the JSON text of a results file."""
    return json.dumps(to_jsonable(dict(results)), indent=2, sort_keys=False) + "\n"


def scalars(results: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level numbers of `results` (what a task logs to wandb as metrics)."""
    return {k: v for k, v in results.items() if isinstance(v, (int, float))}


class WandbMode(enum.Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.offline
    project: str = "moescope"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)



class Telemetry:
    """One task run's outputs. Use as a context manager; wandb is finished on exit."""

    def __init__(self, cfg: DictConfig | Mapping[str, Any], task: str, run_dir: Optional[Path] = None):
        self.cfg = cfg
        self.task = task
        self.run_dir = Path(run_dir) if run_dir is not None else (hydra_run_dir() or Path("runs") / task / "adhoc")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._wandb_run: Any = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "Telemetry":
        self._start_wandb()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish(exit_code=1 if exc_type else 0)
            self._wandb_run = None

    def _config_dict(self) -> dict[str, Any]:
        if isinstance(self.cfg, DictConfig):
            return OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]
        return to_jsonable(dict(self.cfg))

    def _start_wandb(self) -> None:
        wcfg = self._config_dict().get("wandb", {}) or {}
        mode = str(wcfg.get("mode", "offline"))
        if mode == "disabled":
            return
        import wandb  # heavy and optional: only when a run logs to wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        job = multirun_job()
        # a multirun is one wandb group (its folder's name), its jobs the runs in it, named by their overrides
        group = wcfg.get("group") or (f"{self.task}/{job[0].parent.name}" if job else None)
        name = wcfg.get("name") or (",".join(job[1]) or job[0].name if job else None)
        self._wandb_run = wandb.init(
            mode=mode,
            project=wcfg.get("project", "moescope"),
            entity=wcfg.get("entity"),
            group=group,
            name=name,
            tags=list(wcfg.get("tags") or []) or None,
            job_type=self.task,
            dir=str(self.run_dir),
            config=self._config_dict(),
            reinit="finish_previous",
        )
        where = {"project": wcfg.get("project", "moescope"), "entity": wcfg.get("entity"), "group": group,
                 "mode": mode, "run_id": self._wandb_run.id}
        atomic_write_text(self.run_dir / WANDB_RUN, json.dumps(where) + "\n")

    @property
    def wandb_run(self) -> Any:
        return self._wandb_run

    # ---- outputs ------------------------------------------------------------------------------
    def log(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        """Log scalars to wandb (no-op when disabled)."""
        if self._wandb_run is not None:
            self._wandb_run.log(to_jsonable(dict(metrics)), step=step)

    def write_results(self, results: Mapping[str, Any], name: str = "results.json") -> Path:
        """Write `results` (JSON) into the run folder atomically and mirror scalars to wandb summary."""
        path = self.run_dir / name
        atomic_write_text(path, results_text(results))
        if self._wandb_run is not None:
            for key, value in _flatten(results).items():
                if isinstance(value, (int, float, str, bool)):
                    self._wandb_run.summary[key] = value
        return path

    def finish(self, results: Mapping[str, Any], title: str, rows: Mapping[str, Any], metrics: Optional[Mapping[str, Any]]
               ) -> None:
        """The end of every task: results.json, `metrics` logged to wandb (None: none) and the summary table."""
        self.write_results(results)
        if metrics is not None:
            self.log(metrics)
        self.summary(title, rows)

    def save_figure(self, fig: Any, name: str) -> Path:
        """Save a matplotlib figure as PNG in the run folder and log it to wandb."""
        path = self.run_dir / name
        fig.savefig(path, dpi=120, bbox_inches="tight")
        if self._wandb_run is not None:
            import wandb  # already loaded by the run that logs (see above)

            self._wandb_run.log({path.stem: wandb.Image(str(path))})
        return path

    def summary(self, title: str, rows: Mapping[str, Any]) -> Table:
        """Print a two-column table of the scalar entries of `rows` (nested keys joined by '/')."""
        table = Table(title=title, show_header=True, header_style="bold")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in _flatten(rows).items():
            if isinstance(value, float):
                text = f"{value:.4g}"
            elif isinstance(value, (int, str, bool)) or value is None:
                text = str(value)
            else:
                continue
            table.add_row(key, text)
        console.print(table)
        return table

    def progress(self, iterable: Iterable[T], description: str, total: Optional[int] = None) -> Iterator[T]:
        """Iterate with a rich progress bar (silent when stdout is not a terminal and CI is set)."""
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        disable = bool(os.environ.get("CI")) or not console.is_terminal
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=disable,
                      transient=True) as bar:
            handle = bar.add_task(description, total=total)
            for item in iterable:
                yield item
                bar.advance(handle)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, prefix=f"{name}/"))
        else:
            out[name] = to_jsonable(value)
    return out
