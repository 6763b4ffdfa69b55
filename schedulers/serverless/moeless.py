"""MoEless (serverless experts): Expert Scaler (Alg. 1) then Expert Placer (Alg. 2) per layer.

The ablations of MoEless §6.5 switch the components off one at a time: without the scaler every
expert keeps one replica; without the placer replicas go to fixed devices (an expert's first
replica to its static expert-parallel home, further ones round-robin to the next devices), with
no regard for load or warm starts. "Without the predictor" is the serving loop's business (it
feeds historical loads instead of forecasts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from core.routing_stats import coefficient_of_variation
from schedulers.ep_placement import Placement, PlacementStats, PolicyBase, ReplicaSettings, check_devices_experts, \
    register
from schedulers.serverless.moeless_placer import place_replicas
from schedulers.serverless.moeless_scaler import scale_replicas


def default_slots(num_experts: int, num_devices: int) -> int:
    """MoEless's replica slots per device without `capacity_slots`: twice the static share, 2 * ceil(E / G)."""
    return 2 * -(-num_experts // num_devices)


@dataclass(frozen=True)
class MoElessSettings(ReplicaSettings):
    kind: str = "moeless"
    label: str = "MoEless"
    capacity_slots: Optional[int] = None  # replica slots per device per layer; None: 2 * ceil(E / G)
    cv_threshold: float = 0.2  # V (MoEless §6.4 uses 0.2)
    memory_cap_replicas: Optional[int] = None  # M_cap / M_e: added replicas per layer; None: every free slot
    max_replicas_per_expert: Optional[int] = None  # None: unbounded (paper)
    use_scaler: bool = True
    use_placer: bool = True
    warm_start: bool = True

    def slots_per_device(self, num_experts: int, num_devices: int) -> int:
        return self.capacity_slots or default_slots(num_experts, num_devices)


def home_device(expert: int, num_experts: int, num_devices: int) -> int:
    """The device a contiguous expert-parallel split (Megatron) gives `expert`."""
    return expert * num_devices // num_experts


def fixed_placement(counts: np.ndarray, num_devices: int, capacity: int) -> Placement:
    """Load-oblivious placement (the "no placer" ablation): replica j of expert e goes to device
    home(e) + j, or the next device with a free slot."""
    counts = np.asarray(counts, dtype=np.int64)
    E = counts.size
    used = np.zeros(num_devices, dtype=np.int64)
    experts, devices = [], []
    for e in range(E):
        for j in range(int(counts[e])):
            g = (home_device(e, E, num_devices) + j) % num_devices
            for _ in range(num_devices):
                if used[g] < capacity:
                    break
                g = (g + 1) % num_devices
            else:
                raise ValueError(f"fixed_placement: {int(counts.sum())} replicas exceed {num_devices} x {capacity} slots")
            used[g] += 1
            experts.append(e)
            devices.append(g)
    return Placement(E, num_devices, np.asarray(experts, np.int64), np.asarray(devices, np.int64))


@register("moeless", settings=MoElessSettings)
class MoElessPolicy(PolicyBase):
    """Elastic replicas per layer from forecast loads (MoEless §4.2-4.3); decides from forecasts only."""

    serverless = True
    uses_forecast = True

    def __init__(self, num_experts: int, num_devices: int, capacity: int, expert_bytes: float,
                 settings: MoElessSettings = MoElessSettings(), name: str = "MoEless"):
        check_devices_experts(num_experts, num_devices, "moeless")
        if capacity * num_devices < num_experts:
            raise ValueError(f"moeless: {num_devices} devices x {capacity} slots cannot hold {num_experts} experts")
        self.name = name
        self.num_experts = num_experts
        self.num_devices = num_devices
        self.capacity = capacity
        self.expert_bytes = float(expert_bytes)
        self.settings = settings
        free = capacity * num_devices - num_experts
        cap = free if settings.memory_cap_replicas is None else min(settings.memory_cap_replicas, free)
        self.memory_cap_bytes = cap * self.expert_bytes

    @classmethod
    def from_settings(cls, settings: MoElessSettings, num_experts: int, num_devices: int,
                      expert_bytes: float) -> "MoElessPolicy":
        return cls(num_experts, num_devices, settings.slots_per_device(num_experts, num_devices), expert_bytes,
                   settings, name=settings.label)

    def plan(self, layer: int, forecast: np.ndarray, live: Optional[Placement], now_s: Optional[float] = None
             ) -> Placement:
        forecast = np.asarray(forecast, dtype=np.float64)
        s = self.settings
        hit_cap = False
        cv = None
        if s.use_scaler:
            scaled = scale_replicas(forecast, s.cv_threshold, self.expert_bytes, self.memory_cap_bytes,
                                    max_total_replicas=self.capacity * self.num_devices,
                                    max_replicas_per_expert=s.max_replicas_per_expert)
            counts, hit_cap, cv = scaled.counts, scaled.hit_cap, scaled.cv  # CV of the replica loads W_l
        else:
            counts = np.ones(self.num_experts, dtype=np.int64)
        if s.use_placer:
            result = place_replicas(counts, forecast, self.num_devices, self.capacity, live, warm_start=s.warm_start)
            placement, warm, cold = result.placement, result.warm, result.cold
        else:
            placement = fixed_placement(counts, self.num_devices, self.capacity)
            warm = cold = 0
        self._stats = PlacementStats(hit_memory_cap=hit_cap,
                                     forecast_cv=float(coefficient_of_variation(forecast)) if cv is None else cv,
                                     warm_replicas=warm, cold_replicas=cold)
        return placement
