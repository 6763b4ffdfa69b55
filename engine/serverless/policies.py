"""A served or simulated system: a registered serverless policy's settings and the forecast it plans from.

The policies, their settings and their replica slots per device live in `schedulers/serverless/` (registered
in `schedulers.ep_placement.SERVERLESS`); this module only adds what the mechanism decides: where the
forecast loads come from (the predictor at distance d, or history).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

from schedulers.ep_placement import SERVERLESS, ReplicaPolicy, ReplicaSettings, build_replica_policy


class ForecastKind(enum.Enum):
    predictor = "predictor"  # the load predictor at distance d (history for the first d layers)
    history = "history"  # historical loads only ("no predictor" ablation)


@dataclass(frozen=True)
class SystemSpec:
    """One simulated or served system: a policy's settings (`settings.kind` names it) and its forecasts."""

    settings: ReplicaSettings
    forecast: ForecastKind = ForecastKind.predictor
    distance: int = 1

    @property
    def kind(self) -> str:
        return self.settings.kind

    @property
    def label(self) -> str:
        return self.settings.label

    def key(self) -> tuple:
        """Systems with equal keys behave identically (deduplicated across experiments); the forecast only
        matters to a policy that plans from it."""
        settings = replace(self.settings, label="")
        if SERVERLESS.entry_for(self.settings).policy.uses_forecast:
            return (settings, self.forecast, self.distance)
        return (settings,)

    def with_settings(self, **changes: Any) -> "SystemSpec":
        return replace(self, settings=replace(self.settings, **changes))

    def with_label(self, label: str) -> "SystemSpec":
        return self.with_settings(label=label)


def slots_per_device(spec: SystemSpec, num_experts: int, num_devices: int) -> int:
    """Replica slots each device offers the system for one layer (the policy's own rule)."""
    return spec.settings.slots_per_device(num_experts, num_devices)


def build_policy(spec: SystemSpec, num_experts: int, num_devices: int, expert_bytes: float) -> ReplicaPolicy:
    return build_replica_policy(spec.settings, num_experts, num_devices, expert_bytes)
