"""Replica slots of one MoE layer on the devices of the `ep` axis, holding real expert weights.

Each device owns S slots (arrays [S, H, 2F] and [S, F, H] on that device). Applying a placement
follows the `SlotMap`: warm replicas stay where they are, cold ones are copied into a free slot
from a peer device that holds the expert (device to device) or from the host master copy; the
bytes of each kind are counted. The sharded [G * S, ...] arrays the EP layer reads are assembled
from the per-device buffers without copying (`jax.make_array_from_single_device_arrays`).

Multi-host: every process keeps the same slot bookkeeping (policies are deterministic) but only
touches the buffers of its own devices; a peer copy from another host's device is replaced by a
copy from the local host master.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from engine.serverless.ep_layer import EP_AXIS
from engine.serverless.slots import EMPTY, SlotMap, SlotUpdate, Source
from schedulers.ep_placement import Placement


def _write_slot(buf: jax.Array, value: jax.Array, slot: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), slot, 0)


_write_slot_donated = jax.jit(_write_slot, donate_argnums=0)  # in place: a copy touches one slot only


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
        gu_shape = (slots_per_device, *self.master_gate_up[0].shape)
        dn_shape = (slots_per_device, *self.master_down[0].shape)
        self.gate_up = {g: jax.device_put(np.zeros(gu_shape, self.dtype), self.devices[g]) for g in self.local}
        self.down = {g: jax.device_put(np.zeros(dn_shape, self.dtype), self.devices[g]) for g in self.local}
        self.bytes = {"host": 0, "peer": 0}
        self.copies = {src.value: 0 for src in Source}

    def live(self) -> Placement | None:
        return self.slot_map.live()

    def apply(self, placement: Placement) -> SlotUpdate:
        """Move weights so the slots hold `placement`; returns the slot of every replica."""
        before = self.slot_map.expert.copy()
        update = self.slot_map.apply(placement)
        local = set(self.local)
        staged = []  # read every source before writing any slot (a slot may be a source and a target)
        for m in update.moves:
            self.copies[m.source.value] += 1
            if m.source is Source.warm:
                continue
            kind = "peer" if m.source is Source.peer else "host"
            self.bytes[kind] += self.expert_bytes
            if m.device not in local:
                continue
            target = self.devices[m.device]
            if m.source is Source.peer and m.src_device in local:
                src_slot = int(np.flatnonzero(before[m.src_device] == m.expert)[0])
                gu = jax.device_put(self.gate_up[m.src_device][src_slot], target)
                dn = jax.device_put(self.down[m.src_device][src_slot], target)
            else:
                gu = jax.device_put(self.master_gate_up[m.expert], target)
                dn = jax.device_put(self.master_down[m.expert], target)
            staged.append((m.device, m.slot, gu, dn))
        for g, s, gu, dn in staged:
            slot = jnp.int32(s)
            self.gate_up[g] = _write_slot_donated(self.gate_up[g], gu, slot)
            self.down[g] = _write_slot_donated(self.down[g], dn, slot)
        return update

    def arrays(self) -> tuple[jax.Array, jax.Array]:
        """gate_up [G * S, H, 2F] and down [G * S, F, H], sharded over `ep` (device g: slots g*S..)."""
        sharding = NamedSharding(self.mesh, P(EP_AXIS))
        G, S = self.num_devices, self.slots
        gu = jax.make_array_from_single_device_arrays((G * S, *self.master_gate_up[0].shape), sharding,
                                                      [self.gate_up[g] for g in self.local])
        dn = jax.make_array_from_single_device_arrays((G * S, *self.master_down[0].shape), sharding,
                                                      [self.down[g] for g in self.local])
        return gu, dn

    def slot_contents(self) -> np.ndarray:
        """int64 [G, S]: expert in each slot (-1 empty)."""
        return self.slot_map.expert.copy()


__all__ = ["DeviceReplicaStore", "EMPTY"]
