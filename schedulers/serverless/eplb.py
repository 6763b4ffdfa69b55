"""DeepSeek's expert-parallel load balancer (EPLB), our numpy implementation, and its serving policy.

The algorithm (DeepSeek-V3 report, deepseek-ai/EPLB README) turns historical loads of E logical
experts into P >= E physical experts (replicas) packed onto G devices, P / G per device:

1. replicate: P - E times, give one more replica to the expert with the highest load per replica;
2. balanced packing: items heaviest first, each to the pack with the least weight among the packs
   that still have room (every pack takes exactly n / m items).

Hierarchical policy (number of expert groups divisible by the number of nodes): first pack expert
groups onto nodes (balanced packing of group loads), then replicate within each node, then pack
each node's physical experts onto its devices. Global policy (otherwise): one group on one node,
replicate globally, pack onto all devices. Ties go to the lowest index (stable sorting).

`EPLBPolicy` serves with it the way vLLM runs it (`EPLBConfig`): a fixed number of redundant
experts, rearranged every `rebalance_interval_steps` serving steps (vLLM `step_interval`, 3000) from
the loads of the last `window_steps` steps (vLLM `window_size`, 1000); between rearrangements the
placement is frozen. The first rearrangement comes after the first interval (until then the
placement of uniform loads). `async_transfer` (vLLM `use_async`, on in its current releases) moves
the new weights in the background while the old placement serves; off, the step waits for them.
MoEless §6.1's reading, a rearrangement every ten minutes of trace time, is `rebalance_interval_s`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Optional

import numpy as np

from schedulers.ep_placement import Placement, PlacementStats, PolicyBase, ReplicaSettings, check_devices_experts, \
    register


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack n items into `num_packs` packs of exactly n / num_packs items, loads as even as possible.

    weight: float [n]. Returns pack index int64 [n] and the item's rank inside its pack int64 [n].
    """
    w = np.asarray(weight, dtype=np.float64).reshape(-1)
    n = w.size
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"balanced_packing: {n} items do not split evenly into {num_packs} packs")
    per_pack = n // num_packs
    if per_pack == 1:
        return np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    pack_index = np.full(n, -1, dtype=np.int64)
    rank = np.full(n, -1, dtype=np.int64)
    pack_weight = np.zeros(num_packs, dtype=np.float64)
    pack_items = np.zeros(num_packs, dtype=np.int64)
    for item in np.argsort(-w, kind="stable"):
        open_packs = np.flatnonzero(pack_items < per_pack)
        p = int(open_packs[np.argmin(pack_weight[open_packs])])
        pack_index[item] = p
        rank[item] = pack_items[p]
        pack_weight[p] += w[item]
        pack_items[p] += 1
    return pack_index, rank


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate n logical experts into `num_physical` replicas minimising the largest load per replica.

    Returns phy2log int64 [P] (logical expert of each physical one; the first n are the experts
    themselves), rank int64 [P] (replica number of that expert), logcnt int64 [n] (replicas per expert).
    """
    w = np.asarray(weight, dtype=np.float64).reshape(-1)
    n = w.size
    if num_physical < n:
        raise ValueError(f"replicate_experts: {num_physical} physical experts < {n} logical experts")
    phy2log = np.concatenate([np.arange(n), np.zeros(num_physical - n, dtype=np.int64)]).astype(np.int64)
    rank = np.zeros(num_physical, dtype=np.int64)
    logcnt = np.ones(n, dtype=np.int64)
    for i in range(n, num_physical):
        e = int(np.argmax(w / logcnt))
        phy2log[i] = e
        rank[i] = logcnt[e]
        logcnt[e] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


def rebalance_layer(weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_devices: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hierarchical EPLB on one layer (global when num_groups = num_nodes = 1).

    weight: float [E]. Returns phy2log int64 [P] in device order (physical expert p sits on device
    p // (P / G)), the replica rank of each physical expert int64 [P], and logcnt int64 [E].
    """
    w = np.asarray(weight, dtype=np.float64).reshape(-1)
    E = w.size
    for cond, msg in ((E % num_groups == 0, f"num_groups={num_groups} does not divide {E} experts"),
                      (num_groups % num_nodes == 0, f"num_nodes={num_nodes} does not divide num_groups={num_groups}"),
                      (num_devices % num_nodes == 0, f"num_nodes={num_nodes} does not divide {num_devices} devices"),
                      (num_physical % num_devices == 0, f"{num_physical} physical experts do not split over "
                                                         f"{num_devices} devices"),
                      (num_physical >= E, f"{num_physical} physical experts < {E} logical experts")):
        if not cond:
            raise ValueError(f"eplb: {msg}")
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    per_device = num_physical // num_devices
    log_per_node = E // num_nodes
    phy_per_node = num_physical // num_nodes

    # 1. expert groups -> nodes; experts renumbered so node n owns "middle" ids [n*E/nodes, (n+1)*E/nodes)
    group_pack, group_rank = balanced_packing(w.reshape(num_groups, group_size).sum(axis=1), num_nodes)
    log2mlog = ((group_pack * groups_per_node + group_rank) * group_size)[:, None] + np.arange(group_size)
    log2mlog = log2mlog.reshape(-1)
    mlog2log = _inverse(log2mlog)
    mlog_weight = w[mlog2log].reshape(num_nodes, log_per_node)

    phy2log = np.empty(num_physical, dtype=np.int64)
    phyrank_out = np.empty(num_physical, dtype=np.int64)
    mlogcnt_all = np.empty(E, dtype=np.int64)
    for node in range(num_nodes):
        # 2. replicate inside the node
        phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_weight[node], phy_per_node)
        mlogcnt_all[node * log_per_node:(node + 1) * log_per_node] = mlogcnt
        # 3. the node's physical experts -> its devices
        phy_load = (mlog_weight[node] / mlogcnt)[phy2mlog]
        pack, rank = balanced_packing(phy_load, num_devices // num_nodes)
        pphy2phy = _inverse(pack * per_device + rank)
        pphy2mlog = phy2mlog[pphy2phy] + node * log_per_node
        block = slice(node * phy_per_node, (node + 1) * phy_per_node)
        phy2log[block] = mlog2log[pphy2mlog]
        phyrank_out[block] = phyrank[pphy2phy]
    logcnt = mlogcnt_all[log2mlog]
    return phy2log, phyrank_out, logcnt


def rebalance_experts(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_devices: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB entry point over L layers: weight float [L, E] -> phy2log int64 [L, P], log2phy int64
    [L, E, max replicas] (-1 padded) and logcnt int64 [L, E]. The hierarchical policy is used when
    num_nodes divides num_groups, the global one otherwise."""
    w = np.asarray(weight, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"rebalance_experts: weight must be [layers, experts], got shape {w.shape}")
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    rows = [rebalance_layer(w[layer], num_replicas, num_groups, num_nodes, num_devices) for layer in range(w.shape[0])]
    phy2log = np.stack([r[0] for r in rows])
    phyrank = np.stack([r[1] for r in rows])
    logcnt = np.stack([r[2] for r in rows])
    L, E = w.shape
    log2phy = np.full((L, E, int(logcnt.max())), -1, dtype=np.int64)
    for layer in range(L):
        log2phy[layer, phy2log[layer], phyrank[layer]] = np.arange(num_replicas)
    return phy2log, log2phy, logcnt


@dataclass(frozen=True)
class EPLBSettings(ReplicaSettings):
    kind: str = "eplb"
    label: str = "EPLB"
    num_redundant: Optional[int] = None  # physical minus logical experts per layer; None: one per device
    rebalance_interval_steps: int = 3000  # vLLM EPLBConfig.step_interval
    window_steps: int = 1000  # vLLM EPLBConfig.window_size: loads of this many recent steps
    # trace-time cadence instead of steps (MoEless §6.1: "periodically (e.g., every ten minutes)"); None: steps
    rebalance_interval_s: Optional[float] = None
    history_window_s: Optional[float] = None  # with rebalance_interval_s: loads over this much time; None: the interval
    async_transfer: bool = True  # vLLM EPLBConfig.use_async: weights move in the background
    num_groups: int = 1  # expert groups (DeepSeek group-limited routing); 1: global policy
    num_nodes: int = 1

    def slots_per_device(self, num_experts: int, num_devices: int) -> int:
        """The physical experts (logical + redundant) per device."""
        redundant = num_devices if self.num_redundant is None else self.num_redundant
        return -(-(num_experts + redundant) // num_devices)


@register("eplb", settings=EPLBSettings)
class EPLBPolicy(PolicyBase):
    """EPLB as a serving baseline: frozen placement, recomputed from recent history every interval.

    Step cadence (default): steps are counted per layer by `observe` (weighted by the iterations an
    observation stands for); a layer is rearranged at its first plan once `rebalance_interval_steps`
    have passed since the last rearrangement (or the start), from the loads of the last `window_steps`.
    Time cadence (`rebalance_interval_s`): the first rearrangement at the first plan after an
    observation, then every interval of trace time, from the last `history_window_s`.
    """

    def __init__(self, num_experts: int, num_devices: int, settings: EPLBSettings = EPLBSettings(),
                 name: str = "EPLB"):
        check_devices_experts(num_experts, num_devices, "eplb")
        redundant = num_devices if settings.num_redundant is None else settings.num_redundant
        physical = num_experts + redundant
        if redundant < 0 or physical % num_devices:
            raise ValueError(f"eplb.num_redundant: {num_experts} experts + {redundant} redundant = {physical} "
                             f"physical experts, not a multiple of {num_devices} devices")
        if settings.rebalance_interval_s is None and (settings.rebalance_interval_steps < 1 or settings.window_steps < 1):
            raise ValueError(f"eplb: rebalance_interval_steps and window_steps must be >= 1, got "
                             f"{settings.rebalance_interval_steps} and {settings.window_steps}")
        self.name = name
        self.num_experts = num_experts
        self.num_devices = num_devices
        self.num_physical = physical
        self.settings = settings
        self.by_time = settings.rebalance_interval_s is not None
        if self.by_time:
            self.window = settings.history_window_s if settings.history_window_s is not None else settings.rebalance_interval_s
        else:
            self.window = float(settings.window_steps)
        self.transfer = "background" if settings.async_transfer else "blocking"
        # per layer: (clock, iterations x loads) of the observations in the window, and their sum
        self._history: dict[int, Deque[tuple[float, np.ndarray]]] = {}
        self._history_sum: dict[int, np.ndarray] = {}
        self._current: dict[int, Placement] = {}
        self._rebalanced_at: dict[int, Optional[float]] = {}
        self._steps: dict[int, float] = {}  # serving steps observed per layer
        self._now = 0.0
        self.rebalances = 0

    @classmethod
    def from_settings(cls, settings: EPLBSettings, num_experts: int, num_devices: int,
                      expert_bytes: float) -> "EPLBPolicy":
        return cls(num_experts, num_devices, settings, name=settings.label)

    @property
    def slots_per_device(self) -> int:
        return self.num_physical // self.num_devices

    def placement_from_weights(self, weight: np.ndarray) -> Placement:
        groups, nodes = self.settings.num_groups, self.settings.num_nodes
        if groups % nodes:
            groups, nodes = 1, 1
        phy2log, _, _ = rebalance_layer(weight, self.num_physical, groups, nodes, self.num_devices)
        devices = np.arange(self.num_physical, dtype=np.int64) // self.slots_per_device
        return Placement(self.num_experts, self.num_devices, phy2log, devices)

    def _history_weight(self, layer: int) -> Optional[np.ndarray]:
        return self._history_sum.get(layer) if self._history.get(layer) else None

    def _due(self, layer: int, now: float) -> bool:
        last = self._rebalanced_at.get(layer)
        if self.by_time:
            return last is None or now - last >= self.settings.rebalance_interval_s
        return self._steps.get(layer, 0.0) - (last or 0.0) >= self.settings.rebalance_interval_steps

    def plan(self, layer: int, forecast: np.ndarray, live: Optional[Placement], now_s: Optional[float] = None
             ) -> Placement:
        now = self._now if now_s is None else float(now_s)
        rebalanced = False
        if layer not in self._current:
            self._current[layer] = self.placement_from_weights(np.ones(self.num_experts))
            self._rebalanced_at[layer] = None
        if self._due(layer, now):
            weight = self._history_weight(layer)
            if weight is not None:
                self._current[layer] = self.placement_from_weights(weight)
                self._rebalanced_at[layer] = now if self.by_time else self._steps.get(layer, 0.0)
                rebalanced = True
        self.rebalances += int(rebalanced)
        self._stats = PlacementStats(extra={"rebalanced": rebalanced})
        return self._current[layer]

    def observe(self, layer: int, actual: np.ndarray, now_s: float, iterations: float = 1.0) -> None:
        self._now = float(now_s)
        steps = self._steps.get(layer, 0.0) + float(iterations)
        self._steps[layer] = steps
        clock = self._now if self.by_time else steps
        hist = self._history.setdefault(layer, deque())
        loads = np.asarray(actual, dtype=np.float64) * float(iterations)
        hist.append((clock, loads))
        total = self._history_sum.get(layer)
        self._history_sum[layer] = loads.copy() if total is None else total + loads
        # time: observations older than the window; steps: keep the last `window_steps` steps
        while hist and (clock - hist[0][0] > self.window if self.by_time else clock - hist[0][0] >= self.window):
            _, old = hist.popleft()
            self._history_sum[layer] -= old
