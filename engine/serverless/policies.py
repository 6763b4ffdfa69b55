"""Policy objects from settings: the four systems of MoEless §6 and their variants."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Optional

from schedulers.eplb import EPLBPolicy, EPLBSettings
from schedulers.ep_placement import ReplicaPolicy
from schedulers.moeless import MoElessPolicy, MoElessSettings
from schedulers.oracle_balance import OracleBalancePolicy
from schedulers.static_ep import StaticEPPolicy


class PolicyKind(enum.Enum):
    static_ep = "static_ep"  # Megatron-LM
    eplb = "eplb"
    oracle = "oracle"  # lossy upper bound
    moeless = "moeless"


class ForecastKind(enum.Enum):
    predictor = "predictor"  # the load predictor at distance d (history for the first d layers)
    history = "history"  # historical loads only ("no predictor" ablation)


@dataclass(frozen=True)
class SystemSpec:
    """One simulated or served system: a policy, its settings, and the forecast it plans from."""

    kind: PolicyKind
    label: str
    moeless: MoElessSettings = field(default_factory=MoElessSettings)
    eplb: EPLBSettings = field(default_factory=EPLBSettings)
    forecast: ForecastKind = ForecastKind.predictor
    distance: int = 1
    capacity_slots: Optional[int] = None  # MoEless replica slots per device (None: 2 * ceil(E / G))

    def key(self) -> tuple:
        """Systems with equal keys behave identically (deduplicated across experiments)."""
        if self.kind is PolicyKind.moeless:
            return (self.kind, self.moeless, self.forecast, self.distance, self.capacity_slots)
        if self.kind is PolicyKind.eplb:
            return (self.kind, self.eplb)
        return (self.kind,)

    def with_label(self, label: str) -> "SystemSpec":
        return replace(self, label=label)


def default_slots(num_experts: int, num_devices: int) -> int:
    return 2 * -(-num_experts // num_devices)


def slots_per_device(spec: SystemSpec, num_experts: int, num_devices: int) -> int:
    """Replica slots each device offers the system for one layer."""
    if spec.kind is PolicyKind.moeless:
        return spec.capacity_slots or default_slots(num_experts, num_devices)
    if spec.kind is PolicyKind.eplb:
        redundant = num_devices if spec.eplb.num_redundant is None else spec.eplb.num_redundant
        return -(-(num_experts + redundant) // num_devices)
    return -(-num_experts // num_devices)


def build_policy(spec: SystemSpec, num_experts: int, num_devices: int, expert_bytes: float) -> ReplicaPolicy:
    if spec.kind is PolicyKind.static_ep:
        return StaticEPPolicy(num_experts, num_devices, name=spec.label)
    if spec.kind is PolicyKind.oracle:
        return OracleBalancePolicy(num_experts, num_devices, name=spec.label)
    if spec.kind is PolicyKind.eplb:
        return EPLBPolicy(num_experts, num_devices, spec.eplb, name=spec.label)
    return MoElessPolicy(num_experts, num_devices, slots_per_device(spec, num_experts, num_devices), expert_bytes,
                         spec.moeless, name=spec.label)
