"""One registry pattern for the policies of both modes: a name, the policy class and its settings dataclass.

A policy module registers itself with a class decorator next to the settings it owns:

    @dataclass(frozen=True)
    class MySettings(SchedulerSettings):      # the registry's base settings + this policy's own knobs
        kind: str = "mine"                     # the registered name, the config's `kind`
        label: str = "Mine"
        depth: int = 2

    @OFFLOAD.register("mine", settings=MySettings)
    class Mine(OffloadPolicy): ...

The registry finds its policies by importing every module of its package once (`pkgutil`), on the first
lookup and again on a miss: no list of modules is kept anywhere. A new policy is its module in the package
(`schedulers/offload/` or `schedulers/serverless/`) and its YAML (`conf/scheduler/<name>.yaml`,
`conf/serverless/policy/<name>.yaml`), which extends the schema `base_<name>` that `conf/schemas` registers
from `schemas()`. Policy only: no device, no I/O.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from omegaconf import DictConfig, OmegaConf

from core.config import to_frozen


@dataclass(frozen=True)
class Entry:
    """One registered policy."""

    name: str
    policy: type  # the policy class
    settings: type  # its frozen settings dataclass (a subclass of the registry's base)


class Registry:
    """Policies of one kind (offload schedulers, serverless replica policies) by name.

    package: the package whose modules register the policies; what: the kind of policy in messages;
    key: the config key a name comes from (named by errors); base: the class every policy's settings extend.
    """

    def __init__(self, package: str, what: str, key: str, base: type):
        self.package, self.what, self.key, self.base = package, what, key, base
        self._entries: dict[str, Entry] = {}
        self._imported: set[str] = set()

    # ---- registration ---------------------------------------------------------------------------------
    def register(self, name: str, *, settings: type) -> Callable[[type], type]:
        """Class decorator: record the decorated policy class under `name` with its `settings` dataclass."""
        self._check_settings(name, settings)

        def deco(cls: type) -> type:
            known = self._entries.get(name)
            if known is not None and (known.policy.__module__, known.policy.__qualname__) != \
                    (cls.__module__, cls.__qualname__):
                raise TypeError(f"{self.what} {name!r}: registered twice ({known.policy.__module__}."
                                f"{known.policy.__qualname__} and {cls.__module__}.{cls.__qualname__})")
            self._entries[name] = Entry(name, cls, settings)
            return cls

        return deco

    def _check_settings(self, name: str, settings: type) -> None:
        where = f"{self.what} {name!r}: settings {getattr(settings, '__name__', settings)!r}"
        if not (isinstance(settings, type) and dataclasses.is_dataclass(settings) and issubclass(settings, self.base)):
            raise TypeError(f"{where} must be a dataclass extending {self.base.__name__}")
        if not settings.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"{where} must be frozen (@dataclass(frozen=True))")
        kind = {f.name: f for f in dataclasses.fields(settings)}["kind"].default
        if kind != name:
            raise TypeError(f"{where}: `kind` defaults to {kind!r}; it must default to the registered name {name!r}")

    def discover(self) -> None:
        """Import every module of the package not imported yet (each registers what it defines)."""
        package = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(package.__path__, prefix=f"{self.package}."):
            if info.name not in self._imported:
                self._imported.add(info.name)
                importlib.import_module(info.name)

    # ---- lookup ------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every registered name, sorted."""
        if not self._imported:
            self.discover()
        return sorted(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter([self._entries[name] for name in self.names()])

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        if name not in self._entries:
            self.discover()  # a miss: look for modules added since
        return name in self._entries

    def get(self, name: Any, key: Optional[str] = None) -> Entry:
        """The policy registered as `name`; otherwise a one-line ValueError naming the config `key` (default:
        the registry's) and every known name."""
        if not isinstance(name, str) or name not in self:
            raise ValueError(f"{key or self.key}: {name!r} is not a registered {self.what} "
                             f"(known: {', '.join(self.names())})")
        return self._entries[name]

    def entry_for(self, settings: Any) -> Entry:
        """The entry of `settings.kind`, checking that `settings` are that policy's settings."""
        entry = self.get(getattr(settings, "kind", None))
        if not isinstance(settings, entry.settings):
            raise ValueError(f"{self.key}: {entry.name!r} takes {entry.settings.__name__}, "
                             f"got {type(settings).__name__}")
        return entry

    def schemas(self) -> Iterator[tuple[str, type]]:
        """(name, settings class) of every policy: what `conf/schemas` registers as `base_<name>`."""
        for entry in self:
            yield entry.name, entry.settings

    # ---- config -> settings ----------------------------------------------------------------------------
    def settings_from(self, node: Any, where: str) -> Any:
        """The frozen settings a config node describes (the one place a Hydra node becomes policy settings).

        node: a composed DictConfig, a mapping, or settings; `kind` names the policy, every other key must
        be one of that policy's settings. where: the node's config path (errors name `<where>.<key>`)."""
        if isinstance(node, self.base):
            self.entry_for(node)
            return node
        values = plain(node)
        entry = self.get(values.get("kind"), key=f"{where}.kind")
        known = {f.name for f in dataclasses.fields(entry.settings)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: not a setting of {self.what} {entry.name!r} "
                             f"(its settings: {', '.join(sorted(known))})")
        return to_frozen(values, entry.settings)


def plain(node: Any) -> dict[str, Any]:
    """A config node as a plain dict (enums kept)."""
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True, enum_to_str=False)  # type: ignore[return-value]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    if isinstance(node, Mapping):
        return dict(node)
    raise TypeError(f"policy settings: expected a config node or a mapping, got {type(node).__name__}")
