"""Schema of the `scheduler` group: one offload policy and its knobs (`schedulers.base.SchedulerSettings`)."""

from __future__ import annotations

from conf import unfrozen
from conf.schemas import store
from schedulers.base import SchedulerSettings

store(unfrozen(SchedulerSettings), name="base_scheduler", group="scheduler")
