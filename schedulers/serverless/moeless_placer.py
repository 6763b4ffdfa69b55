"""MoEless Expert Placer (MoEless §4.3, Algorithm 2): warm starts first, else Join-the-Shortest-Queue.

Replicas are taken most-loaded first (a replica of expert e carries W_e / R_e). A replica whose
expert is still alive on some device from the previous placement (a kept-alive function) is
placed there: a warm start moves no weights. Otherwise it joins the device with the smallest
aggregated load so far. Devices offer `capacity` replica slots each; a full device is skipped.

Two details the pseudo-code leaves open, fixed here: among several warm devices of the same
expert the least-loaded one is taken; each live replica warm-starts at most one new replica.
Ties go to the lowest expert id, then the lowest device id, so the result is deterministic.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from schedulers.ep_placement import Placement


@dataclass(frozen=True)
class PlacementResult:
    placement: Placement
    warm: int  # replicas placed on a device that already held their expert
    cold: int  # replicas that need weights moved in


def replica_order(counts: Sequence[int], loads: Sequence[float]) -> list[tuple[float, int]]:
    """(load per replica, expert) for every replica, most loaded first, ties by expert id."""
    items = sorted((-load / n, e) for e, (n, load) in enumerate(zip(counts, loads)) if n > 0 for _ in range(n))
    return [(-neg, e) for neg, e in items]


def place_replicas(counts: np.ndarray, loads: np.ndarray, num_devices: int, capacity: int,
                   live: Optional[Placement] = None, warm_start: bool = True) -> PlacementResult:
    """Algorithm 2 on one layer.

    counts: int [E] replicas per expert (the scaler's output); loads: float [E] forecast tokens per
    expert; capacity: replica slots per device; live: the replicas alive now (None: cold start);
    warm_start False gives plain JSQ (an ablation).
    """
    counts = np.asarray(counts, dtype=np.int64).reshape(-1).tolist()  # plain lists: this runs per layer per iteration
    E = len(counts)
    if num_devices < 1 or capacity < 1:
        raise ValueError(f"place_replicas: need num_devices >= 1 and capacity >= 1, got {num_devices}, {capacity}")
    if sum(counts) > num_devices * capacity:
        raise ValueError(f"place_replicas: {sum(counts)} replicas exceed {num_devices} devices x "
                         f"{capacity} slots")
    if live is not None and (live.num_experts != E or live.num_devices != num_devices):
        raise ValueError(f"place_replicas: live placement is for {live.num_experts} experts on {live.num_devices} "
                         f"devices, expected {E} on {num_devices}")
    warm_devices: dict[int, list[int]] = {}
    if live is not None and warm_start:
        for e, g in zip(live.replica_expert.tolist(), live.replica_device.tolist()):
            warm_devices.setdefault(e, []).append(g)
    # a lazy min-heap over (load, device)
    device_load = [0.0] * num_devices
    used = [0] * num_devices
    queue = [(0.0, g) for g in range(num_devices)]  # entries go stale when a device's load changes
    experts_out, devices_out = [], []
    warm = cold = 0
    for share, e in replica_order(counts, np.asarray(loads, dtype=np.float64).reshape(-1).tolist()):
        g = -1
        for d in warm_devices.get(e, ()):  # the least-loaded warm device with a free slot
            if used[d] < capacity and (g < 0 or (device_load[d], d) < (device_load[g], g)):
                g = d
        if g >= 0:
            warm_devices[e].remove(g)
            warm += 1
        else:
            while True:  # the least-loaded device with a free slot (lowest id on ties)
                load, g = heapq.heappop(queue)
                if used[g] < capacity and load == device_load[g]:
                    break
            cold += 1
        device_load[g] += share
        used[g] += 1
        if used[g] < capacity:
            heapq.heappush(queue, (device_load[g], g))
        experts_out.append(e)
        devices_out.append(g)
    placement = Placement.trusted(E, num_devices, experts_out, devices_out)
    return PlacementResult(placement=placement, warm=warm, cold=cold)
