"""Replica slots of one MoE layer on the devices of the `ep` axis, holding real expert weights.

Device g's slot s holds one expert as arrays [1, 2F, H] and [1, H, F] on device g. Applying a
placement follows the `SlotMap`: warm replicas stay where they are, cold ones are copied into a
free slot from a peer device that holds the expert (a device-to-device transfer) or from the host
master copy; the bytes of each kind are counted. A copy is a transfer only (no computation runs
on the device, so nothing compiles per device). The EP layer reads slot s of all devices as one
[G, ...] array sharded over `ep`, assembled without copying (`jax.make_array_from_single_device_arrays`).

Multi-host: every process keeps the same slot bookkeeping (policies are deterministic) but only
touches the buffers of its own devices; a peer copy from another host's device is replaced by a
copy from the local host master.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from engine.serverless.ep_layer import EP_AXIS
from engine.serverless.slots import EMPTY, SlotMap, SlotUpdate, Source
from schedulers.ep_placement import Placement


class DeviceReplicaStore:
    """The S replica slots per device of one MoE layer; master weights stay on the host."""

    def __init__(self, mesh: Mesh, gate_up: Sequence, down: Sequence, slots_per_device: int):
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(f"replica store: {len(gate_up)} gate_up and {len(down)} down expert weights")
        self.mesh = mesh
        self.devices = list(np.asarray(mesh.devices).reshape(-1))
        self.num_devices = len(self.devices)
        self.slots = slots_per_device
        self.master_gate_up = [np.asarray(w) for w in gate_up]
        self.master_down = [np.asarray(w) for w in down]
        self.dtype = self.master_gate_up[0].dtype
        self.expert_bytes = int(self.master_gate_up[0].nbytes + self.master_down[0].nbytes)
        self.slot_map = SlotMap(len(gate_up), self.num_devices, slots_per_device)
        me = jax.process_index()
        self.local = [g for g, d in enumerate(self.devices) if d.process_index == me]
        zeros_gu = np.zeros((1, *self.master_gate_up[0].shape), self.dtype)
        zeros_dn = np.zeros((1, *self.master_down[0].shape), self.dtype)
        # [slot][device] -> single-device array [1, ...] (local devices only)
        self.gate_up = [{g: jax.device_put(zeros_gu, self.devices[g]) for g in self.local} for _ in range(slots_per_device)]
        self.down = [{g: jax.device_put(zeros_dn, self.devices[g]) for g in self.local} for _ in range(slots_per_device)]
        self.bytes = {"host": 0, "peer": 0}
        self.copies = {src.value: 0 for src in Source}

    def live(self) -> Placement | None:
        return self.slot_map.live()

    def apply(self, placement: Placement) -> SlotUpdate:
        """Move weights so the slots hold `placement`; returns the slot of every replica."""
        before = self.slot_map.expert.copy()
        update = self.slot_map.apply(placement)
        local = set(self.local)
        old_gu = [dict(slot) for slot in self.gate_up]  # sources are read from the state before this update
        old_dn = [dict(slot) for slot in self.down]
        for m in update.moves:
            self.copies[m.source.value] += 1
            if m.source is Source.warm:
                continue
            self.bytes["peer" if m.source is Source.peer else "host"] += self.expert_bytes
            if m.device not in local:
                continue
            target = self.devices[m.device]
            if m.source is Source.peer and m.src_device in local:
                src_slot = int(np.flatnonzero(before[m.src_device] == m.expert)[0])
                gu, dn = old_gu[src_slot][m.src_device], old_dn[src_slot][m.src_device]
            else:
                gu, dn = self.master_gate_up[m.expert][None], self.master_down[m.expert][None]
            self.gate_up[m.slot][m.device] = jax.device_put(gu, target)
            self.down[m.slot][m.device] = jax.device_put(dn, target)
        return update

    def arrays(self) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """Per slot s: gate_up [G, 2F, H] and down [G, H, F], sharded over `ep` (row g on device g)."""
        sharding = NamedSharding(self.mesh, P(EP_AXIS))
        G = self.num_devices
        gu_shape = (G, *self.master_gate_up[0].shape)
        dn_shape = (G, *self.master_down[0].shape)
        gu = tuple(jax.make_array_from_single_device_arrays(gu_shape, sharding, [slot[g] for g in self.local])
                   for slot in self.gate_up)
        dn = tuple(jax.make_array_from_single_device_arrays(dn_shape, sharding, [slot[g] for g in self.local])
                   for slot in self.down)
        return gu, dn

    def slot_contents(self) -> np.ndarray:
        """int64 [G, S]: expert in each slot (-1 empty)."""
        return self.slot_map.expert.copy()


__all__ = ["DeviceReplicaStore", "EMPTY"]
