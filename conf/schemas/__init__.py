"""Typed schemas of every config group and task, registered in Hydra's ConfigStore. A schema lives with
the module it configures (OWNED below) or, for a task's top-level config, here; each registers itself
on import (`core.config.store`)."""

from __future__ import annotations

import importlib
import pkgutil

_REGISTERED = False

# config groups whose schema is owned by the module it configures
OWNED = ("models.loading", "predictors.config", "schedulers.hardware", "engine.workloads.config", "engine.sim.routing")


def register_all() -> None:
    """Import every schema module of this package once (each calls `store`)."""
    global _REGISTERED
    if _REGISTERED:
        return
    for module in OWNED:
        importlib.import_module(module)
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    _REGISTERED = True
