"""Typed schemas of every config group and task; each module registers its own on import."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from hydra.core.config_store import ConfigStore

_REGISTERED = False


def store(node: Any, name: str, group: str | None = None) -> None:
    """Register `node` as `base_<name>` (in `group` when given) in Hydra's ConfigStore."""
    ConfigStore.instance().store(group=group, name=name, node=node)


def register_all() -> None:
    """Import every schema module of this package once (each calls `store`)."""
    global _REGISTERED
    if _REGISTERED:
        return
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    _REGISTERED = True
