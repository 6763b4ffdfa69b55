"""Hydra configuration tree of moescope: YAML groups next to this file, typed schemas in `schemas/`.

Every entry point is decorated with `hydra_main("<task>")`; the schemas register themselves in
Hydra's ConfigStore on import, so a wrong type or an unknown key fails at start with a message
naming the key.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import hydra
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from conf import schemas
from core.config import CONF_DIR, USER_ERRORS, register_resolvers, report_user_error
from core.telemetry import Telemetry, completed_results, mark_complete, multirun_job


def hydra_main(config_name: str) -> Callable[[Callable[[Any], Any]], Callable[[], Any]]:
    """`hydra.main` over this package's config tree, version_base 1.3, schemas registered; a user error ends
    the process with one line and exit status 2 (the full traceback with HYDRA_FULL_ERROR=1)."""
    schemas.register_all()
    register_resolvers()

    def wrap(task: Callable[[Any], Any]) -> Callable[[], Any]:
        @functools.wraps(task)
        def quiet_task(cfg: Any) -> Any:
            # Hydra logs at INFO; jax's backend probing (no TPU/GPU here) is noise at that level.
            logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
            logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save at INFO
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                return task(cfg)
            try:
                return task(cfg)
            except USER_ERRORS as exc:
                report_user_error(config_name, exc)
                raise SystemExit(2) from None

        main = hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(quiet_task)

        @functools.wraps(task)
        def entry() -> Any:
            return main()

        return entry

    return wrap


def hydra_task(config_name: str, title: str | Callable[[dict], str] | None = None, hide: tuple[str, ...] = (),
               summarize: Optional[Callable[[dict], Mapping[str, Any]]] = None,
               metrics: Optional[Callable[[dict], Mapping[str, Any]]] = None,
               prepare: Optional[Callable[[Any], Any]] = None
               ) -> Callable[[Callable[[Any, Telemetry], dict]], Callable[[], Any]]:
    """The one `main` of a task: `hydra_main(config_name)` around `task(node, telemetry) -> results`, in a run
    folder with wandb (`Telemetry`); then results.json, the `metrics` of the results logged (default: none)
    and a summary table titled `title` (default: the task) of `summarize(results)` (default: the results
    without the `hide` keys). `prepare(node) -> node`, when given, settles the node first (a study job's point
    applied), so wandb records the config the task runs. `main.run(node, run_dir=None)` runs the same task
    in-process (tests)."""

    def wrap(task: Callable[[Any, Telemetry], dict]) -> Callable[[], Any]:
        @functools.wraps(task)
        def run(node: Any, run_dir: Optional[Path] = None) -> dict:
            job = multirun_job() if run_dir is None else None
            if job is not None:  # a rerun of the same multirun skips the jobs it finished (resume)
                done = completed_results(*job)
                if done is not None:
                    logging.getLogger(__name__).info("%s: complete in %s, skipped", " ".join(job[1]), job[0])
                    return done
            started = time.time()
            if prepare is not None:
                node = prepare(node)
            with Telemetry(node, task=config_name, run_dir=run_dir) as tm:
                results = task(node, tm)
                heading = title(results) if callable(title) else (title or config_name)
                rows = summarize(results) if summarize else {k: v for k, v in results.items() if k not in hide}
                tm.finish(results, heading, rows, metrics(results) if metrics else None)
            if job is not None:
                mark_complete(job[0], job[1], started)
            return results

        main = hydra_main(config_name)(run)
        main.run = run  # type: ignore[attr-defined]  # the same task in-process: run(node, run_dir=None)
        return main

    return wrap


def compose(config_name: str, overrides: Optional[list[str]] = None) -> Any:
    """Compose a task config: outside a Hydra app (tests, notebooks) or inside one (a study job's other configs)."""
    schemas.register_all()
    register_resolvers()
    if GlobalHydra.instance().is_initialized():  # inside a Hydra app (a study job): its search path is this tree
        return hydra_compose(config_name=config_name, overrides=list(overrides or []), return_hydra_config=False)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []), return_hydra_config=False)
