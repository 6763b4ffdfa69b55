"""CRAFT (arXiv 2603.28768, "Cost-aware Expert Replica Allocation with Fine-grained Layerwise Estimations"):
replicas chosen under a memory budget, layer by layer, where they pay.

What the paper states publicly (abstract and summaries; the full text was not read): existing replication
schemes over-replicate, many replicas add little balance; CRAFT estimates each layer's replication benefit
and solves a memory-budgeted allocation (a knapsack over layers) so that replicas go to the layers that gain
most, then places them with the serving framework's balancer. Our reading, at EPLB's cadence:

- every `rebalance_interval_steps` (as EPLB, from the loads of the last `window_steps`), for every layer l
  and every number r of redundant replicas in 0..`max_redundant_per_layer`, the layer time T_l(r) of EPLB's
  replication (`replicate_experts`) packed onto the devices (heaviest first onto the least-loaded device
  with a free slot), forecast from the window's mean loads with the machine's layer-time function
  (`ReplicaTiming`: weight streaming included, so a replica that only adds streaming has no benefit);
- an exact knapsack (dynamic programme over layers) picks the r_l that minimise sum_l T_l(r_l) with
  sum_l r_l <= `budget_replicas_per_layer` x L;
- replicas a layer no longer uses are freed (CRAFT returns memory to the KV cache), so the memory held is
  the replicas in use.

Departures: the benefit is our simulator's layer time, not CRAFT's profiled throughput estimate; the
allocation is recomputed at each rearrangement from the window (not once offline); the placement is our
greedy packing, not the host framework's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from schedulers.ep_placement import Placement, PlacementStats, ReplicaTiming, register
from schedulers.serverless.eplb import EPLBPolicy, EPLBSettings, replicate_experts


@dataclass(frozen=True)
class CRAFTSettings(EPLBSettings):
    kind: str = "craft"
    label: str = "CRAFT"
    budget_replicas_per_layer: float = 4.0  # the memory budget: redundant replicas per layer on average
    max_redundant_per_layer: Optional[int] = None  # None: one per device

    def slots_per_device(self, num_experts: int, num_devices: int) -> int:
        most = num_devices if self.max_redundant_per_layer is None else self.max_redundant_per_layer
        return -(-(num_experts + most) // num_devices)


def pack_replicas(weight: np.ndarray, redundant: int, num_devices: int, capacity: int) -> Placement:
    """EPLB's replication of `redundant` extra replicas, packed heaviest first onto the least-loaded device
    with a free slot (`capacity` slots per device)."""
    E = weight.size
    phy2log, _, logcnt = replicate_experts(weight, E + redundant)
    share = weight[phy2log] / logcnt[phy2log]
    load = np.zeros(num_devices)
    used = np.zeros(num_devices, dtype=np.int64)
    devices = np.empty(phy2log.size, dtype=np.int64)
    for p in np.argsort(-share, kind="stable"):
        open_ = np.flatnonzero(used < capacity)
        g = int(open_[np.argmin(load[open_])])
        devices[p] = g
        load[g] += share[p]
        used[g] += 1
    return Placement(E, num_devices, phy2log, devices)


def allocate(times: np.ndarray, budget: int) -> np.ndarray:
    """Knapsack: times float [L, R+1] (layer l's time with r redundant replicas) -> int64 [L] the r_l that
    minimise the summed time with sum r_l <= budget (ties: fewer replicas)."""
    L, R1 = times.shape
    budget = max(0, min(int(budget), L * (R1 - 1)))
    best = np.zeros(budget + 1)  # best[b]: least total time of the layers so far using at most b replicas
    choice = np.zeros((L, budget + 1), dtype=np.int64)
    for layer in range(L):
        nxt = np.full(budget + 1, np.inf)
        for r in range(R1):
            cand = np.full(budget + 1, np.inf)
            cand[r:] = best[:budget + 1 - r] + times[layer, r]
            better = cand < nxt - 1e-15
            nxt[better] = cand[better]
            choice[layer, better] = r
        best = nxt
    out = np.zeros(L, dtype=np.int64)
    b = budget
    for layer in range(L - 1, -1, -1):
        out[layer] = choice[layer, b]
        b -= out[layer]
    return out


@register("craft", settings=CRAFTSettings)
class CRAFTPolicy(EPLBPolicy):
    """EPLB's cadence and history; the replicas per layer from a memory-budgeted knapsack over the layers."""

    def __init__(self, num_experts: int, num_devices: int, settings: CRAFTSettings = CRAFTSettings(),
                 name: str = "CRAFT"):
        most = num_devices if settings.max_redundant_per_layer is None else settings.max_redundant_per_layer
        if settings.budget_replicas_per_layer < 0 or most < 0:
            raise ValueError(f"craft: budget_replicas_per_layer and max_redundant_per_layer must be >= 0, got "
                             f"{settings.budget_replicas_per_layer} and {most}")
        super().__init__(num_experts, num_devices, EPLBSettings(num_redundant=0, **{
            k: getattr(settings, k) for k in ("rebalance_interval_steps", "window_steps", "rebalance_interval_s",
                                              "history_window_s", "async_transfer")}), name=name)
        self.craft = settings
        self.max_redundant = most
        self.capacity = settings.slots_per_device(num_experts, num_devices)
        self._redundant: dict[int, int] = {}
        self._allocated_at = -1.0

    @classmethod
    def from_settings(cls, settings: CRAFTSettings, num_experts: int, num_devices: int,
                      expert_bytes: float) -> "CRAFTPolicy":
        return cls(num_experts, num_devices, settings, name=settings.label)

    @property
    def slots_per_device(self) -> int:
        return self.capacity

    def _layer_times(self, weights: dict[int, np.ndarray], timing: Optional[ReplicaTiming]) -> np.ndarray:
        layers = sorted(weights)
        times = np.zeros((len(layers), self.max_redundant + 1))
        for i, layer in enumerate(layers):
            steps = max(self._steps.get(layer, 1.0), 1.0)
            mean = weights[layer] / min(steps, self.window)  # tokens per iteration over the window
            for r in range(self.max_redundant + 1):
                p = pack_replicas(mean, r, self.num_devices, self.capacity)
                times[i, r] = timing.layer_s(p, mean) if timing is not None else float(p.device_loads(mean).max())
        return times

    def _allocate(self) -> None:
        weights = {layer: w for layer in self._history if (w := self._history_weight(layer)) is not None}
        if not weights:
            return
        times = self._layer_times(weights, self.timing)
        counts = allocate(times, int(self.craft.budget_replicas_per_layer * len(weights)))
        self._redundant = dict(zip(sorted(weights), counts.tolist()))

    def placement_for(self, layer: int, weight: np.ndarray) -> Placement:
        return pack_replicas(np.asarray(weight, np.float64), self._redundant.get(layer, 0), self.num_devices,
                             self.capacity)

    def plan(self, layer: int, forecast: np.ndarray, live: Optional[Placement], now_s: Optional[float] = None
             ) -> Placement:
        now = self._now if now_s is None else float(now_s)
        rebalanced = False
        if layer not in self._current:
            self._current[layer] = self.placement_for(layer, np.ones(self.num_experts))
            self._rebalanced_at[layer] = None
        if self._due(layer, now):
            weight = self._history_weight(layer)
            if weight is not None:
                clock = now if self.by_time else self._steps.get(layer, 0.0)
                if clock != self._allocated_at:  # one knapsack over every layer per rearrangement round
                    self._allocate()
                    self._allocated_at = clock
                self._current[layer] = self.placement_for(layer, weight)
                self._rebalanced_at[layer] = clock
                rebalanced = True
        self.rebalances += int(rebalanced)
        self._stats = PlacementStats(extra={"rebalanced": rebalanced, "redundant": self._redundant.get(layer, 0)})
        return self._current[layer]
