"""Static expert parallelism (Megatron-LM): E / G contiguous experts per device, one replica each.

Megatron requires `num_experts % ep_size == 0` and gives rank r the experts
[r * E / G, (r + 1) * E / G). The placement never changes; every expert's memory stays resident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from schedulers.ep_placement import Placement, PolicyBase, ReplicaSettings, check_devices_experts, register


def static_placement(num_experts: int, num_devices: int) -> Placement:
    """Expert e on device e // (E / G)."""
    check_devices_experts(num_experts, num_devices, "static_ep")
    if num_experts % num_devices:
        raise ValueError(f"static_ep: num_experts={num_experts} is not a multiple of num_devices={num_devices} "
                         "(Megatron-LM expert parallelism needs E % G == 0)")
    experts = np.arange(num_experts, dtype=np.int64)
    return Placement(num_experts, num_devices, experts, experts // (num_experts // num_devices))


@dataclass(frozen=True)
class StaticEPSettings(ReplicaSettings):
    """No knobs of its own: one replica per expert, E / G per device."""

    kind: str = "static_ep"
    label: str = "Megatron-LM"


@register("static_ep", settings=StaticEPSettings)
class StaticEPPolicy(PolicyBase):
    """The Megatron-LM baseline of MoEless §6.1: no load balancing."""

    def __init__(self, num_experts: int, num_devices: int, name: str = "Megatron-LM"):
        self.name = name
        self.placement = static_placement(num_experts, num_devices)

    @classmethod
    def from_settings(cls, settings: ReplicaSettings, num_experts: int, num_devices: int,
                      expert_bytes: float) -> "StaticEPPolicy":
        return cls(num_experts, num_devices, name=settings.label)

    def plan(self, layer: int, forecast: np.ndarray, live: Optional[Placement], now_s: Optional[float] = None
             ) -> Placement:
        return self.placement
