"""Schemas of the `scheduler` group: each registered offload policy's own settings (`schedulers.base.OFFLOAD`) as
`base_<kind>`, which its `conf/scheduler/<kind>.yaml` extends, so a YAML key that is not one of that policy's
settings fails at start, naming the key."""

from __future__ import annotations

from core.config import unfrozen, store
from schedulers.base import OFFLOAD

for _kind, _settings in OFFLOAD.schemas():
    store(unfrozen(_settings), name=f"base_{_kind}", group="scheduler")
