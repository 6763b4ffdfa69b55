"""MoEless (serverless experts): Expert Scaler (Alg. 1) then Expert Placer (Alg. 2) per layer.

The ablations of MoEless §6.5 switch the components off one at a time: without the scaler every
expert keeps one replica; without the placer replicas go to fixed devices (an expert's first
replica to its static expert-parallel home, further ones round-robin to the next devices), with
no regard for load or warm starts. "Without the predictor" is the serving loop's business (it
feeds historical loads instead of forecasts).

MoEless at its own strength adds four knobs the paper's loop (`literal`-ly: every one off) lacks:

- `keep_alive_s`: a replica the placements stop using stays resident this many seconds after its
  last use, then its slot is freed (serverless keep-alive; None: until the slot is overwritten, the
  paper loop). Kept-alive replicas are held memory and billed as held.
- `hysteresis`: the scaler keeps the layer's replica counts while the forecast's replica-load CV
  under them stays at most V + hysteresis (it scales only when the balance really degrades).
- `copy_aware`: a new plan replaces the current one only if the layer time it saves (forecast with
  the machine's layer-time function, `ReplicaTiming`) over `lifetime_iterations` iterations repays the
  copies it needs (the busiest device's receive time: a peer copy where a device holds the expert,
  else a cold copy from host memory; their bandwidths come from the hardware profile).
- `cost_aware_scaling`: the scaler's replicas are kept only where the machine's layer time forecasts
  them faster than one replica per expert (in decode every replica streams its whole expert, so
  balancing tokens by replication can cost more than it saves).
- `peer_copies`: new replicas copied from a peer that holds the expert (warm copies) or always from
  host memory (cold copies, each function loading its own weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from core.routing_stats import coefficient_of_variation
from schedulers.ep_placement import Placement, PlacementStats, PolicyBase, ReplicaSettings, ReplicaTiming, \
    check_devices_experts, register
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
    keep_alive_s: Optional[float] = None  # None: kept alive until the slot is overwritten (paper loop)
    hysteresis: float = 0.0  # keep the counts while the forecast CV under them is <= V + hysteresis
    copy_aware: bool = False  # re-place only when the forecast saving over lifetime_iterations repays the copies
    # keep the scaler's replicas only if the machine's layer time (weight streaming counted) forecasts them
    # faster than one replica per expert (placed by the same placer); off: Algorithm 1's CV target alone
    cost_aware_scaling: bool = False
    lifetime_iterations: float = 64.0  # the forecast lifetime of a new placement, in serving iterations
    peer_copies: bool = True  # False: every new replica is a cold copy from host memory

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
        if settings.hysteresis < 0 or settings.lifetime_iterations <= 0:
            raise ValueError(f"moeless: hysteresis must be >= 0 and lifetime_iterations > 0, got "
                             f"{settings.hysteresis} and {settings.lifetime_iterations}")
        if settings.keep_alive_s is not None and settings.keep_alive_s < 0:
            raise ValueError(f"moeless.keep_alive_s must be >= 0 or null, got {settings.keep_alive_s}")
        self.keep_alive_s = settings.keep_alive_s
        self.peer_copies = settings.peer_copies
        self._current: dict[int, Placement] = {}  # the placement each layer serves with now
        self.kept = 0  # plans the copy-aware rule turned down (the current placement kept)

    @classmethod
    def from_settings(cls, settings: MoElessSettings, num_experts: int, num_devices: int,
                      expert_bytes: float) -> "MoElessPolicy":
        return cls(num_experts, num_devices, settings.slots_per_device(num_experts, num_devices), expert_bytes,
                   settings, name=settings.label)

    def plan(self, layer: int, forecast: np.ndarray, live: Optional[Placement], now_s: Optional[float] = None
             ) -> Placement:
        forecast = np.asarray(forecast, dtype=np.float64)
        s = self.settings
        current = self._current.get(layer) if live is not None else None
        hit_cap = False
        cv = None
        if s.use_scaler:
            counts = self._held_counts(current, forecast)
            if counts is None:
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
        if s.cost_aware_scaling and s.use_placer and self.timing is not None and counts.sum() > self.num_experts:
            single = place_replicas(np.ones(self.num_experts, dtype=np.int64), forecast, self.num_devices,
                                    self.capacity, live, warm_start=s.warm_start)
            if self.timing.layer_s(single.placement, forecast) <= self.timing.layer_s(placement, forecast):
                placement, warm, cold = single.placement, single.warm, single.cold
        if s.copy_aware and current is not None and not self._repays(current, placement, forecast, live):
            placement, warm, cold = current, current.num_replicas, 0
            self.kept += 1
        self._current[layer] = placement
        self._stats = PlacementStats(hit_memory_cap=hit_cap,
                                     forecast_cv=float(coefficient_of_variation(forecast)) if cv is None else cv,
                                     warm_replicas=warm, cold_replicas=cold)
        return placement

    def _held_counts(self, current: Optional[Placement], forecast: np.ndarray) -> Optional[np.ndarray]:
        """The current replica counts while the forecast's replica-load CV under them stays within V + hysteresis
        (None: scale afresh)."""
        if current is None or self.settings.hysteresis <= 0:
            return None
        counts = current.replica_counts()
        if np.any((forecast > 0) & (counts == 0)):
            return None
        shares = np.repeat(forecast / np.maximum(counts, 1), counts)
        if float(coefficient_of_variation(shares)) <= self.settings.cv_threshold + self.settings.hysteresis:
            return counts
        return None

    def _repays(self, current: Placement, candidate: Placement, forecast: np.ndarray, live: Placement) -> bool:
        """Whether moving from `current` to `candidate` saves, over the forecast lifetime, more layer time than
        the busiest device waits for its copies. Without a timing (no cost model bound) every plan is taken."""
        timing = self.timing
        if timing is None:
            return True
        if np.any((forecast > 0) & (current.replica_counts() == 0)):
            return True  # the current placement cannot serve the forecast
        copy = copy_seconds(candidate, live, timing, self.peer_copies)
        if copy <= 0.0:
            return True
        saving = timing.layer_s(current, forecast) - timing.layer_s(candidate, forecast)
        return saving * self.settings.lifetime_iterations > copy


def copy_seconds(candidate: Placement, live: Placement, timing: ReplicaTiming, peer_copies: bool = True) -> float:
    """Seconds the busiest device needs to receive the replicas of `candidate` that are not alive on it in
    `live`: a peer copy when some device holds the expert (and `peer_copies`), else a copy from host memory."""
    alive: dict[tuple[int, int], int] = {}
    for e, g in zip(live.replica_expert.tolist(), live.replica_device.tolist()):
        alive[(e, g)] = alive.get((e, g), 0) + 1
    held = set(live.replica_expert.tolist()) if peer_copies else set()
    per_device = [0.0] * candidate.num_devices
    for e, g in zip(candidate.replica_expert.tolist(), candidate.replica_device.tolist()):
        if alive.get((e, g), 0) > 0:
            alive[(e, g)] -= 1
            continue
        per_device[g] += timing.peer_copy_s if e in held else timing.host_copy_s
    return max(per_device, default=0.0)
