"""The serverless (expert-parallel) latency and cost model on a hardware profile.

Per MoE layer and iteration, with W_r the tokens of replica r (W_e / R_e) and W_g the tokens of
device g (the sum over its replicas):

    T_moe = compute + 2 * (c + beta * max_g W_g)

plus T_misc for the layer's non-MoE part (attention and gate, data-parallel). beta is the
hidden-state bytes per token over the per-device all-to-all bandwidth
(`interconnect.gbps_per_device`), c the collective's latency (`interconnect.latency_us`).

Two kinds of replica time (`LatencyKind`, `serverless.latency.kind`):
- `roofline` (the default, every system): the time of a replica is the offload simulator's own
  `schedulers.cost.CostModel.t_g` on the same profile: kernel + call overhead plus a roofline of its
  GEMMs, max(W_r * expert FLOPs / achieved bf16 rate, expert bytes / achieved memory bandwidth).
  Every replica that serves any token streams its whole expert from device memory: at decode batch
  sizes that is most of the layer, and two replicas of one expert read its weights twice. The
  all-to-all adds the interconnect latency c. The constants are the ones `engine.serverless.calibrate`
  fits on named published expert-parallel decode figures (README, "One cost model for both modes").
- `paper` (MoEless §3.3, labelled option): T_r = alpha * W_r with alpha the expert FLOPs per token
  over the achieved bf16 rate, c = 0: compute only, no weight streaming, no fixed cost per replica.

The compute term has two readings (`ComputeKind`); they agree whenever every device holds at most
one replica with tokens (static EP, Oracle with E = G):
- `device_sum` (default): a device processes all its replicas' tokens, max over devices of the
  summed time (MoEless §4.3: "each GPU's computation and communication times are proportional to its
  aggregated expert load"). No placement beats W / G tokens per device, so the Oracle bounds every
  system.
- `replica_max`, the literal §3.3 formula: max over replicas, as if replicas that share a device
  ran side by side at full speed each (then EPLB's 2 replicas per expert beat the Oracle);
  `moe_other_s` keeps this reading beside the headline.

The formula lives in `schedulers.ep_placement.ReplicaTiming` (`timing()`): the cost-aware policies
(MoEless's copy-aware scaler, CRAFT) forecast a layer with the very function it is charged with.

Cost = GPU memory x time, summed over iterations and layers (byte-seconds). Two billings
(`Billing`), both always computed and reported side by side; `latency.billing` picks the headline:

- `held` (default; MoEless §3.3 "the product of GPU memory consumption and inference latency
  aggregated over all iterations"): every system pays for the memory it holds on the GPUs while
  each layer runs, its attention block included. For MoEless that is every replica alive in a slot
  of any layer, the kept-alive ones its warm starts rely on included:

      (T_moe + T_misc) * (M_resident + M_misc)

- `pay_per_use` (MoEless's serverless pricing): a serverless expert is billed only while its own
  layer runs, kept-alive replicas for free; a serverful deployment still pays for what it holds:

      serverless:  T_moe * R * M_e + (T_moe + T_misc) * M_misc
      serverful:   (T_moe + T_misc) * (M_resident + M_misc)

with R the layer's replicas in use, M_resident all layers' resident replicas. T_moe here is the
layer's time including weight copies it had to wait for (see `engine.serverless.simulator`).

Weight copies: a replica placed where its expert is not alive is copied from a peer device (the
interconnect; a bridged pair where the profile has one) or from host memory (a cold start over the
device's host link). `copy_times` gives each device's receive time; the simulator queues them on
the device's link and charges the layer for whatever part the mechanism cannot overlap.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import numpy as np

from schedulers.hardware import HardwareProfile
from models.config import ModelConfig
from schedulers.cost import CostModel, non_expert_params
from schedulers.ep_placement import Placement, ReplicaTiming


class LatencyKind(enum.Enum):
    roofline = "roofline"  # CostModel.t_g per replica (overheads + weight streaming), collective latency: physical
    paper = "paper"  # T_r = alpha * W_r, T_g = beta * W_g (MoEless §3.3): compute only


class Billing(enum.Enum):
    held = "held"  # memory held (kept-alive replicas included) x time, every system (MoEless §3.3)
    pay_per_use = "pay_per_use"  # serverless replicas billed only while their layer runs


class ComputeKind(enum.Enum):
    replica_max = "replica_max"  # max over replicas (MoEless §3.3, literally)
    device_sum = "device_sum"  # max over devices of the replicas' summed time (MoEless §4.3; paper.yaml)


@dataclass(frozen=True)
class LatencySettings:
    kind: LatencyKind = LatencyKind.roofline
    compute: ComputeKind = ComputeKind.device_sum
    misc_s: Optional[float] = None  # fixed T_misc per layer; None: attention block of one device's share
    billing: Billing = Billing.held  # the headline billing; the other is reported next to it


@dataclass(frozen=True)
class LayerTime:
    compute_s: float
    comm_s: float  # one all-to-all (the slowest device); T_moe counts it twice
    moe_s: float
    moe_other_s: float  # T_moe under the other compute kind (replica_max <-> device_sum), for comparison


class ServerlessCostModel:
    """alpha, beta, T_misc and the memory terms for one model on one machine of G devices."""

    def __init__(self, cfg: ModelConfig, hw: HardwareProfile, num_devices: int,
                 settings: LatencySettings = LatencySettings(), bytes_per_param: int = 2, activation_bytes: int = 2):
        if num_devices < 1:
            raise ValueError(f"serverless cost model: num_devices must be >= 1, got {num_devices}")
        if num_devices > 1 and hw.interconnect.gbps_per_device <= 0:
            raise ValueError(f"hardware {hw.name}: interconnect.gbps_per_device must be > 0 for {num_devices} devices")
        self.cfg, self.hw, self.settings = cfg, hw, settings
        self.num_devices = num_devices
        self.ops = CostModel(cfg, hw, bytes_per_param=bytes_per_param)
        self.expert_bytes = float(cfg.expert_bytes(bytes_per_param))
        self.alpha_s = self.ops.expert_flops / (hw.gpu.bf16_tflops * 1e12 * hw.gpu.matmul_efficiency)
        link = hw.interconnect.gbps_per_device * 1e9
        self.beta_s = cfg.hidden_size * activation_bytes / link if link > 0 else 0.0
        self.collective_latency_s = hw.interconnect.latency_us * 1e-6 if settings.kind is LatencyKind.roofline else 0.0
        self.misc_bytes = float(non_expert_params(cfg) * bytes_per_param * num_devices)  # replicated (DP)
        self._timing = ReplicaTiming(replica_times=self.replica_times, comm_per_token_s=self.beta_s,
                                     comm_latency_s=self.collective_latency_s, peer_copy_s=self.peer_copy_s,
                                     host_copy_s=self.host_copy_s)

    def summary(self) -> dict[str, float]:
        return {"alpha_us_per_token": self.alpha_s * 1e6, "beta_us_per_token": self.beta_s * 1e6,
                "expert_mib": self.expert_bytes / 2**20, "misc_gib": self.misc_bytes / 2**30,
                "replica_fixed_us": float(self.ops.t_g(1) - self.alpha_s) * 1e6,
                "peer_copy_ms": self.copy_time(np.zeros(1), np.ones(1)) * 1e3,  # one expert from a peer
                "host_copy_ms": self.copy_time(np.ones(1), np.zeros(1)) * 1e3}  # one expert from host memory

    def replica_times(self, replica_loads: np.ndarray) -> np.ndarray:
        w = np.asarray(replica_loads, dtype=np.float64)
        if self.settings.kind is LatencyKind.paper:
            return self.alpha_s * w
        return np.asarray(self.ops.t_g(w), dtype=np.float64)

    @property
    def peer_copy_s(self) -> float:
        """One expert copied from a peer device (a bridged pair where the profile has one)."""
        link = self.hw.interconnect.pair_gbps or self.hw.interconnect.gbps_per_device
        return self.expert_bytes / (link * 1e9) if link > 0 else 0.0

    @property
    def host_copy_s(self) -> float:
        """One expert copied from host memory over the device's host link (a cold start)."""
        return float(self.hw.host_link.transfer_s(self.expert_bytes))

    def timing(self) -> ReplicaTiming:
        """The layer-time function and copy times a cost-aware policy plans with (the ones it is charged)."""
        return self._timing

    def moe_time(self, placement: Placement, loads: np.ndarray) -> LayerTime:
        """T_moe of one layer: `loads` float [E] the tokens the experts serve."""
        timing = self.timing()
        device_sum, replica_max = timing.compute_s(placement, loads)
        compute, other = (replica_max, device_sum) if self.settings.compute is ComputeKind.replica_max else \
            (device_sum, replica_max)
        comm = timing.comm_s(placement, loads)
        return LayerTime(compute_s=compute, comm_s=comm, moe_s=compute + 2 * comm, moe_other_s=other + 2 * comm)

    def misc_time(self, num_seqs: int, tokens: int, context: float, prefill: bool) -> float:
        """T_misc: one device's share (1 / G of the sequences) of a layer's attention block and gate."""
        if self.settings.misc_s is not None:
            return float(self.settings.misc_s)
        if num_seqs <= 0:
            return 0.0
        per_dev = max(1, -(-num_seqs // self.num_devices))
        if prefill:
            return float(self.ops.t_attn(per_dev, 0, prefill=True, prompt_len=max(1, round(tokens / num_seqs))))
        return float(self.ops.t_attn(per_dev, max(1, round(context))))

    def copy_times(self, host_moves: np.ndarray, peer_moves: np.ndarray) -> np.ndarray:
        """float [G]: seconds each device needs to receive its new replicas' weights, host copies over
        its own host link one after another, peer copies over the device interconnect (a bridged pair
        where the profile has one, else the all-to-all share)."""
        host = np.asarray(host_moves, dtype=np.float64)
        peer = np.asarray(peer_moves, dtype=np.float64)
        return host * self.host_copy_s + peer * self.peer_copy_s

    def copy_time(self, moves_per_device: np.ndarray, peer_moves_per_device: np.ndarray) -> float:
        """Seconds the slowest device needs to receive its replicas' weights (`copy_times`' max)."""
        return float(self.copy_times(moves_per_device, peer_moves_per_device).max(initial=0.0))

    def layer_cost(self, moe_s: float, misc_s: float, held_expert_bytes: float, active_expert_bytes: float,
                   serverless: bool, billing: Billing) -> float:
        """Byte-seconds of one layer under `billing`: `held_expert_bytes` every replica resident on the
        devices (all layers, kept-alive ones included), `active_expert_bytes` the layer's replicas in use."""
        if billing is Billing.pay_per_use and serverless:
            return moe_s * active_expert_bytes + (moe_s + misc_s) * self.misc_bytes
        return (moe_s + misc_s) * (held_expert_bytes + self.misc_bytes)
