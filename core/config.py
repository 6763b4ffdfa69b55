"""moescope's config helpers, below every other package: frozen dataclasses from Hydra nodes
(`to_frozen`, `unfrozen` for schemas), `pkg:` paths, the run-folder tag, ConfigStore registration and the
one-line report of a user error. The YAML tree and the task schemas live in `conf/`."""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import os
import secrets
import sys
import typing
from pathlib import Path
from typing import Any, Optional, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"  # the YAML tree (conf/<group>/<choice>.yaml)
T = TypeVar("T")

_UNFROZEN: dict[type, type] = {}


def unfrozen(cls: type) -> type:
    """A mutable copy of a frozen dataclass (recursively), usable as a Hydra schema.

    OmegaConf marks frozen dataclasses read-only, so YAML could not fill them in; the frozen
    original stays the type the code works with (see `to_frozen`).
    """
    if cls in _UNFROZEN:
        return _UNFROZEN[cls]
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        ftype = _unfreeze_type(hints[f.name])
        kwargs: dict[str, Any] = {}
        if f.default is not dataclasses.MISSING:
            kwargs["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            factory = f.default_factory
            if dataclasses.is_dataclass(factory):
                kwargs["default_factory"] = unfrozen(factory)
            elif dataclasses.is_dataclass(probe := factory()) and not isinstance(probe, type):
                kwargs["default_factory"] = functools.partial(_thaw, probe)  # a factory of frozen instances
            else:
                kwargs["default_factory"] = factory
        else:
            kwargs["default"] = "???"
        specs.append((f.name, ftype, dataclasses.field(**kwargs)))
    schema = dataclasses.make_dataclass(cls.__name__, specs)
    schema.__doc__ = cls.__doc__
    # importable by name (this module's __getattr__ rebuilds it), so a launcher that pickles the config store
    # to its workers (joblib, submitit, Ray) pickles a reference, not a copy that loses dataclasses.MISSING
    schema.__module__ = __name__
    schema.__qualname__ = f"{_UNFROZEN_PREFIX}{cls.__module__.replace('.', '/')}:{cls.__qualname__.replace('.', '/')}"
    _UNFROZEN[cls] = schema
    return schema


_UNFROZEN_PREFIX = "unfrozen:"


def __getattr__(name: str) -> Any:
    """`unfrozen(cls)` by its qualified name (what pickle looks up in another process)."""
    if name.startswith(_UNFROZEN_PREFIX):
        module, _, qualname = name[len(_UNFROZEN_PREFIX):].partition(":")
        cls: Any = importlib.import_module(module.replace("/", "."))
        for part in qualname.split("/"):
            cls = getattr(cls, part)
        return unfrozen(cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _thaw(instance: Any) -> Any:
    """The `unfrozen` copy of a frozen dataclass instance (nested dataclasses thawed too)."""
    values = {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}
    values = {k: _thaw(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v for k, v in values.items()}
    return unfrozen(type(instance))(**values)


def _unfreeze_type(tp: Any) -> Any:
    if dataclasses.is_dataclass(tp):
        return unfrozen(tp)
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)][0]
        return Optional[_unfreeze_type(inner)]
    if origin in (dict, typing.Dict) and len(args) == 2:
        return typing.Dict[args[0], _unfreeze_type(args[1])]  # type: ignore[index]
    if origin in (list, typing.List) and len(args) == 1:
        return typing.List[_unfreeze_type(args[0])]  # type: ignore[index]
    return tp


def to_frozen(node: Any, cls: type[T]) -> T:
    """Build the frozen dataclass `cls` from a DictConfig / dict / schema instance."""
    if isinstance(node, cls):
        return node
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True, enum_to_str=False)
    elif dataclasses.is_dataclass(node):
        node = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in node:
            kwargs[f.name] = _coerce(node[f.name], hints[f.name], f"{cls.__name__}.{f.name}")
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    if value is None:
        return None
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        tp = [a for a in args if a is not type(None)][0]
    if dataclasses.is_dataclass(tp):
        return to_frozen(value, tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp[value] if isinstance(value, str) and value in tp.__members__ else tp(value)
        except ValueError:
            raise ValueError(f"{where}: {value!r} is not one of {[m.name for m in tp]}") from None
    return value


def resolve_path(path: str | Path) -> Path:
    """Resolve `pkg:<relative>` (inside the installed moescope tree) or a plain path."""
    text = str(path)
    if text.startswith("pkg:"):
        return REPO_ROOT / text[len("pkg:"):]
    return Path(text).expanduser()


# what a user can cause and fix (a config value, a file): one line, no traceback (HYDRA_FULL_ERROR=1 shows it)
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                                                 PermissionError, MemoryError, KeyError)


_RUN_TAG: Optional[str] = None


def run_tag() -> str:
    """This process's suffix of run-folder names: its pid and two random bytes, drawn once, so runs started in
    the same second (also on other hosts sharing the folder) never share a folder."""
    global _RUN_TAG
    if _RUN_TAG is None:
        _RUN_TAG = f"{os.getpid()}-{secrets.token_hex(2)}"
    return _RUN_TAG


def register_resolvers() -> None:
    """OmegaConf resolvers the YAML uses (`${run_tag:}` in runs_layout.yaml)."""
    if not OmegaConf.has_resolver("run_tag"):
        OmegaConf.register_new_resolver("run_tag", run_tag)


def report_user_error(task: str, exc: BaseException) -> None:
    """One line on stderr naming the task and what is wrong; the run folder keeps what was already written."""
    text = str(exc).strip().splitlines() or [type(exc).__name__]
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        text = [f"missing key {exc.args[0]!r}"]
    print(f"moescope {task}: error: {text[0]}", file=sys.stderr, flush=True)


def store(node: Any, name: str, group: str | None = None) -> None:
    """Register the schema `node` under `name` (in `group` when given) in Hydra's ConfigStore; every module
    owning a config calls this on import, and `conf.schemas.register_all` imports them."""
    ConfigStore.instance().store(group=group, name=name, node=node)
