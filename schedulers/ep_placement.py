"""Expert replicas over G devices: the plan every expert-parallel policy returns, and its metrics.

A `Placement` says, for one MoE layer, which replica of which expert sits on which device. The
serverless executor (`engine/serverless`) and the simulator both consume it; an expert's tokens
are split evenly over its replicas (MoEless §3.2 step 4), so a replica of expert e serves
W_e / R_e tokens and a device serves the sum over the replicas it holds.

Every policy (`MoElessPolicy`, `EPLBPolicy`, `StaticEPPolicy`, `OracleBalancePolicy` in
`schedulers/serverless/`) follows `ReplicaPolicy`: per layer, forecast loads in, a `Placement` out;
`observe` feeds the loads that actually occurred (history-based policies learn from it). Each module
registers its policy in `SERVERLESS` with the settings it owns (a `ReplicaSettings`, which also says
how many replica slots a device offers it). Policy only: numpy, no device, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Protocol, runtime_checkable

import numpy as np

from schedulers.registry import Registry


def balancedness(device_loads: np.ndarray) -> float:
    """mean / max of the per-device loads (1.0 = perfectly balanced; vLLM / SGLang report it)."""
    v = np.asarray(device_loads, dtype=np.float64)
    peak = v.max() if v.size else 0.0
    return float(v.mean() / peak) if peak > 0 else 1.0


@dataclass(frozen=True)
class Placement:
    """The replicas of one MoE layer: replica r is a copy of expert `replica_expert[r]` on device
    `replica_device[r]`. Every expert with load must have at least one replica.

    `lossy` marks a placement whose policy changes the routing (Oracle): outputs differ from the
    model's.
    """

    num_experts: int
    num_devices: int
    replica_expert: np.ndarray  # int64 [R]
    replica_device: np.ndarray  # int64 [R]
    lossy: bool = False

    def __post_init__(self) -> None:
        e = np.asarray(self.replica_expert, dtype=np.int64).reshape(-1)
        d = np.asarray(self.replica_device, dtype=np.int64).reshape(-1)
        if e.shape != d.shape:
            raise ValueError(f"placement: replica_expert {e.shape} and replica_device {d.shape} differ in length")
        if e.size and (e.min() < 0 or e.max() >= self.num_experts):
            raise ValueError(f"placement: expert ids must lie in [0, {self.num_experts}), got [{e.min()}, {e.max()}]")
        if d.size and (d.min() < 0 or d.max() >= self.num_devices):
            raise ValueError(f"placement: device ids must lie in [0, {self.num_devices}), got [{d.min()}, {d.max()}]")
        object.__setattr__(self, "replica_expert", e)
        object.__setattr__(self, "replica_device", d)

    @classmethod
    def trusted(cls, num_experts: int, num_devices: int, replica_expert: list[int], replica_device: list[int],
                lossy: bool = False) -> "Placement":
        """From id lists a policy built in range by construction: skips the range checks (per-layer hot path)."""
        placement = object.__new__(cls)
        for name, value in (("num_experts", num_experts), ("num_devices", num_devices), ("lossy", lossy),
                            ("replica_expert", np.asarray(replica_expert, dtype=np.int64)),
                            ("replica_device", np.asarray(replica_device, dtype=np.int64))):
            object.__setattr__(placement, name, value)
        return placement

    @classmethod
    def from_lists(cls, num_experts: int, num_devices: int, pairs: list[tuple[int, int]], lossy: bool = False
                   ) -> "Placement":
        """From (expert, device) pairs."""
        arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        return cls(num_experts, num_devices, arr[:, 0], arr[:, 1], lossy)

    # ---- shape ------------------------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        return int(self.replica_expert.shape[0])

    def replica_counts(self) -> np.ndarray:
        """int64 [E]: R_e, the number of replicas of each expert."""
        return np.bincount(self.replica_expert, minlength=self.num_experts).astype(np.int64)

    def replicas_per_device(self) -> np.ndarray:
        """int64 [G]: replica slots each device uses."""
        return np.bincount(self.replica_device, minlength=self.num_devices).astype(np.int64)

    def devices_of(self, expert: int) -> np.ndarray:
        """Devices holding a replica of `expert` (with repeats if a device holds two)."""
        return self.replica_device[self.replica_expert == expert]

    def pairs(self) -> list[tuple[int, int]]:
        """Sorted (expert, device) pairs: two placements with equal pairs are the same plan."""
        return sorted(zip(self.replica_expert.tolist(), self.replica_device.tolist()))

    # ---- loads ------------------------------------------------------------------------------
    def replica_loads(self, loads: np.ndarray) -> np.ndarray:
        """float64 [R]: tokens each replica serves, W_e / R_e (loads: [E] tokens per expert)."""
        loads = np.asarray(loads, dtype=np.float64)
        counts = self.replica_counts()
        per = np.divide(loads, counts, out=np.zeros_like(loads), where=counts > 0)
        return per[self.replica_expert]

    def device_loads(self, loads: np.ndarray) -> np.ndarray:
        """float64 [G]: tokens each device serves (sum over its replicas)."""
        return np.bincount(self.replica_device, weights=self.replica_loads(loads),
                           minlength=self.num_devices).astype(np.float64)

    def check_serves(self, loads: np.ndarray) -> None:
        """Raise if an expert with load has no replica (its tokens would have nowhere to go)."""
        missing = np.flatnonzero((np.asarray(loads) > 0) & (self.replica_counts() == 0))
        if missing.size:
            raise ValueError(f"placement: experts {missing.tolist()} have tokens but no replica")

    def check_capacity(self, capacity: int) -> None:
        """Raise if a device holds more than `capacity` replicas."""
        per = self.replicas_per_device()
        over = np.flatnonzero(per > capacity)
        if over.size:
            raise ValueError(f"placement: devices {over.tolist()} hold {per[over].tolist()} replicas, "
                             f"capacity {capacity}")


def replica_table(placement: Placement) -> np.ndarray:
    """int64 [E, max R_e]: the replica ids of each expert in order, -1 padded."""
    counts = placement.replica_counts()
    table = np.full((placement.num_experts, max(int(counts.max(initial=0)), 1)), -1, dtype=np.int64)
    order = np.argsort(placement.replica_expert, kind="stable")
    ranks = np.arange(order.size) - np.repeat(np.cumsum(counts) - counts, counts)
    table[placement.replica_expert[order], ranks] = order
    return table


def assign_tokens(experts: np.ndarray, placement: Placement) -> np.ndarray:
    """int64 [T, k]: the replica serving each (token, slot), split evenly per expert.

    The n-th assignment to expert e (row-major over [T, k]) goes to e's replica n mod R_e, so the
    replicas of an expert get counts that differ by at most one. The JAX dispatch in
    `engine/serverless` computes the same mapping on device.
    """
    ex = np.asarray(experts, dtype=np.int64)
    flat = ex.reshape(-1)
    counts = placement.replica_counts()
    if flat.size and np.any(counts[flat] == 0):
        missing = sorted(set(flat[counts[flat] == 0].tolist()))
        raise ValueError(f"assign_tokens: experts {missing} are routed to but have no replica")
    order = np.argsort(flat, kind="stable")
    per_expert = np.bincount(flat, minlength=placement.num_experts)
    rank = np.empty(flat.size, dtype=np.int64)
    rank[order] = np.arange(flat.size) - np.repeat(np.cumsum(per_expert) - per_expert, per_expert)
    table = replica_table(placement)
    return table[flat, rank % np.maximum(counts[flat], 1)].reshape(ex.shape)


@dataclass(frozen=True)
class ReplicaTiming:
    """What a cost-aware policy may know of the machine: the time of one MoE layer under a placement and
    the time one expert copy takes. The simulator builds it from its cost model
    (`engine.serverless.latency_model.ServerlessCostModel.timing`) and measures every layer with the same
    function, so a policy's forecast of a layer time and the layer time it is charged cannot disagree.

    replica_times: float [R] tokens per replica -> float [R] seconds each replica takes on its device (0 for
    a replica without tokens; under the physical model a replica with any token streams its whole expert).
    """

    replica_times: Callable[[np.ndarray], np.ndarray]
    comm_per_token_s: float  # one all-to-all, per token the busiest device sends (beta)
    comm_latency_s: float  # one all-to-all's fixed latency
    peer_copy_s: float  # one expert copied from a peer device (warm copy)
    host_copy_s: float  # one expert copied from host memory (cold copy)

    def compute_s(self, placement: "Placement", loads: np.ndarray) -> tuple[float, float]:
        """(max over devices of the summed replica times, max over replicas): the two readings of §3.3."""
        times = self.replica_times(placement.replica_loads(loads))
        per_device = np.bincount(placement.replica_device, weights=times, minlength=placement.num_devices)
        return float(per_device.max(initial=0.0)), float(np.max(times, initial=0.0))

    def comm_s(self, placement: "Placement", loads: np.ndarray) -> float:
        """One all-to-all: latency plus the busiest device's tokens over its link share."""
        return self.comm_latency_s + self.comm_per_token_s * float(placement.device_loads(loads).max(initial=0.0))

    def layer_s(self, placement: "Placement", loads: np.ndarray) -> float:
        """T_moe with each device running its replicas one after another (device_sum), two all-to-alls."""
        return self.compute_s(placement, loads)[0] + 2 * self.comm_s(placement, loads)


@dataclass
class PlacementStats:
    """What a policy reports about one decision (for results and ablations)."""

    hit_memory_cap: bool = False  # scaler stopped at the memory cap before reaching the CV target
    forecast_cv: float = 0.0  # CV of the forecast replica loads after scaling
    warm_replicas: int = 0  # replicas placed on a device that already held that expert
    cold_replicas: int = 0
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ReplicaSettings:
    """What every serverless policy's settings hold (`serverless.policies.<kind>`); each policy's module extends
    it with its own knobs in a frozen dataclass whose `kind` defaults to its registered name."""

    kind: str = ""  # the registered policy (`systems=[<kind>, ...]`: conf/serverless/policy/<kind>.yaml)
    label: str = ""  # name in tables and figures

    def slots_per_device(self, num_experts: int, num_devices: int) -> int:
        """Replica slots each device offers the policy for one layer (here: one replica per expert)."""
        return -(-num_experts // num_devices)


@runtime_checkable
class ReplicaPolicy(Protocol):
    """Per MoE layer: forecast loads -> replicas and their devices."""

    name: str
    serverless: bool  # memory billed per layer while it runs (MoEless) vs resident all the time
    lossy: bool  # changes the routing (Oracle)
    uses_forecast: ClassVar[bool]  # plans from the forecast loads (else from what it observed, or not at all)

    @classmethod
    def from_settings(cls, settings: Any, num_experts: int, num_devices: int, expert_bytes: float) -> "ReplicaPolicy":
        """The policy `settings` describe for E experts over G devices (expert_bytes: one expert's weights)."""
        ...

    def plan(self, layer: int, forecast: np.ndarray, live: Optional[Placement], now_s: Optional[float] = None
             ) -> Placement:
        """forecast: float [E] tokens per expert expected at `layer`; live: the replicas of `layer`
        alive on the devices now (warm-start candidates), None before the first plan; now_s: trace
        time (periodic policies)."""
        ...

    def observe(self, layer: int, actual: np.ndarray, now_s: float, iterations: float = 1.0) -> None:
        """The loads that actually occurred at `layer` (int [E]) at trace time `now_s`; `iterations`: the
        serving iterations this observation stands for (a simulator that samples every n-th decode step)."""
        ...

    def effective_loads(self, actual: np.ndarray) -> np.ndarray:
        """The loads the experts really serve (the routing's, or a lossy policy's re-routing)."""
        ...

    @property
    def last_stats(self) -> PlacementStats:
        ...


class PolicyBase:
    """What the policies share: the last decision's stats, no history, the routing's own loads."""

    serverless = False
    lossy = False
    uses_forecast = False
    # when the weight copies a new placement needs can move: "ahead" (issued when the plan is made,
    # from the forecast d layers early; the layer waits for what has not arrived), "background" (a
    # transfer worker beside inference, never waited for), "blocking" (the layer waits for all of it)
    transfer = "ahead"
    # how long a replica the placements stop using stays resident (seconds of trace time): 0 frees its slot
    # at once (a serverful deployment holds what it uses); None keeps it until its slot is overwritten
    keep_alive_s: Optional[float] = 0.0
    peer_copies = True  # a new replica is copied from a peer that holds the expert (else from host memory)
    timing: Optional[ReplicaTiming] = None  # the layer-time function and copy times (`bind_timing`)
    _stats = PlacementStats()

    def bind_timing(self, timing: ReplicaTiming) -> None:
        """The machine's layer-time function and copy times, for policies that weigh them (the simulator's)."""
        self.timing = timing

    @property
    def last_stats(self) -> PlacementStats:
        return self._stats

    def observe(self, layer: int, actual: np.ndarray, now_s: float, iterations: float = 1.0) -> None:
        """Policies without history ignore what happened."""

    def effective_loads(self, actual: np.ndarray) -> np.ndarray:
        return np.asarray(actual)


def check_devices_experts(num_experts: int, num_devices: int, where: str) -> None:
    if num_experts < 1:
        raise ValueError(f"{where}: num_experts must be >= 1, got {num_experts}")
    if num_devices < 1:
        raise ValueError(f"{where}: num_devices must be >= 1, got {num_devices}")


SERVERLESS = Registry("schedulers.serverless", what="serverless policy", key="systems", base=ReplicaSettings)
register = SERVERLESS.register  # class decorator of a policy module: `@register("name", settings=NameSettings)`


def build_replica_policy(settings: ReplicaSettings, num_experts: int, num_devices: int,
                         expert_bytes: float) -> ReplicaPolicy:
    """The policy `settings.kind` names, for E experts over G devices."""
    return SERVERLESS.entry_for(settings).policy.from_settings(settings, num_experts, num_devices, expert_bytes)
