"""The expert-parallel MoE layer: `jax.shard_map` over a mesh axis of G devices holding replica slots.

Tokens arrive data-parallel (each device owns T / G rows, as attention and the gate left them).
Every device holds S replica slots of this layer (slot s of all devices is one [G, ...] array
sharded over `ep`, so filling a slot is a plain transfer to one device); `ReplicaTables` say which
(device, slot) hosts each replica of each expert. Per device:

1. each (token, k) assignment picks a replica of its expert: the n-th assignment to expert e over
   the whole batch (row-major, device-major) goes to replica n mod R_e, so an expert's tokens split
   evenly over its replicas (`schedulers.ep_placement.assign_tokens` is the numpy reference);
2. dispatch: the rows travel to their replica's device (`all_to_all`, padded to a static capacity
   per device pair; or `ragged_all_to_all` where the backend implements it, not on XLA:CPU);
3. each device runs its slots over the rows it received (grouped by slot, unused slots skipped);
4. combine: the outputs travel back (float32) by the inverse collective and each token sums its k
   expert outputs times the routing weights in float32, in expert-id order, rounding once: with the
   in-memory model's kernels on each device this is the in-memory model's arithmetic.

Exact (dropless) as long as `capacity` is at least the largest count of assignments one device
sends to another (`required_capacity` computes it on the host); the layer returns the number of
assignments that did not fit, which the executor checks is zero, and the rows each slot of each
device received, counted on the device after the dispatch (the loads the replicas really served).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from engine.serverless.dispatch import Dispatch, resolve_dispatch  # noqa: F401  (resolve_dispatch: importers of ep_layer use it)
from models.moe import Routing, experts_grouped, experts_native, native_reads
from schedulers.ep_placement import Placement, assign_tokens

EP_AXIS = "ep"


@jax.tree_util.register_dataclass
@dataclass
class ReplicaTables:
    """Where the replicas of one layer live (replicated on every device).

    device int32 [E, R_max] and slot int32 [E, R_max]: replica r of expert e sits in slot
    `slot[e, r]` of device `device[e, r]` (entries r >= count[e] unused); count int32 [E]: R_e.
    """

    device: jax.Array
    slot: jax.Array
    count: jax.Array


def tables_from_slots(placement: Placement, slot_of_replica: np.ndarray, max_replicas: int) -> dict[str, np.ndarray]:
    """Numpy tables for `ReplicaTables` from a placement and the slot each of its replicas occupies.

    Replica order per expert follows the placement's replica order (the order `assign_tokens` uses).
    """
    E = placement.num_experts
    counts = placement.replica_counts()
    if counts.max(initial=0) > max_replicas:
        raise ValueError(f"replica tables: an expert has {int(counts.max())} replicas, table width {max_replicas}")
    device = np.zeros((E, max_replicas), np.int32)
    slot = np.zeros((E, max_replicas), np.int32)
    seen = np.zeros(E, np.int64)
    for r, (e, g) in enumerate(zip(placement.replica_expert.tolist(), placement.replica_device.tolist())):
        device[e, seen[e]] = g
        slot[e, seen[e]] = slot_of_replica[r]
        seen[e] += 1
    return {"device": device, "slot": slot, "count": counts.astype(np.int32)}


def required_capacity(experts: np.ndarray, valid: np.ndarray, placement: Placement,
                      dispatch: Dispatch = Dispatch.padded) -> int:
    """The dispatch capacity `ep_moe` needs to drop nothing (experts [T, k], T = G * t): padded, the
    most assignments one device sends to one device; ragged, the most one device receives."""
    G = placement.num_devices
    T = experts.shape[0]
    if T % G:
        raise ValueError(f"required_capacity: {T} tokens do not split over {G} devices")
    live = np.asarray(valid, bool).reshape(-1)
    if not live.any():
        return 0
    rep = assign_tokens(experts[live], placement)
    dst = placement.replica_device[rep].reshape(-1)
    if dispatch is Dispatch.ragged:
        return int(np.bincount(dst, minlength=G).max())
    src = np.repeat(np.flatnonzero(live) // (T // G), experts.shape[1])
    return int(np.bincount(src * G + dst, minlength=G * G).max())


def _replica_choice(e: jax.Array, ok: jax.Array, tables: ReplicaTables, num_devices: int
                    ) -> tuple[jax.Array, jax.Array]:
    """(destination device, slot) of each local assignment; e, ok: [n]. Inside shard_map."""
    E = tables.count.shape[0]
    onehot = jax.nn.one_hot(e, E, dtype=jnp.int32) * ok[:, None].astype(jnp.int32)  # [n, E]
    local_rank = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)  # rank among same-expert rows
    counts = jnp.sum(onehot, axis=0)  # [E]
    all_counts = jax.lax.all_gather(counts, EP_AXIS)  # [G, E]
    me = jax.lax.axis_index(EP_AXIS)
    before = jnp.sum(jnp.where(jnp.arange(num_devices)[:, None] < me, all_counts, 0), axis=0)  # [E]
    rank = before[e] + local_rank
    r = rank % jnp.maximum(tables.count[e], 1)
    return tables.device[e, r], tables.slot[e, r]


def _local_experts(rows: jax.Array, slot: jax.Array, gate_up: tuple, down: tuple) -> jax.Array:
    """rows [N, H], slot int32 [N] (S for rows to skip), this device's S slots: gate_up[s] [1, 2F, H],
    down[s] [1, H, F] -> float32 [N, H], each row's expert output unweighted and unrounded.

    The kernels are the in-memory model's (`models.moe.InMemoryExperts`: the native CPU kernels where they read
    these weights, the XLA grouped path elsewhere), and the output stays float32: the source device weights and
    sums a token's k outputs in float32 and rounds once, as the in-memory model does. (Rounding each output to
    the model's dtype here, as this layer once did, rounded twice and moved bf16 logits by up to a rounding step.)
    """
    S = len(gate_up)
    routing = Routing(experts=slot[:, None], weights=(slot < S).astype(jnp.float32)[:, None],
                      logits=jnp.zeros((rows.shape[0], S), jnp.float32))
    gu, dn = [w[0] for w in gate_up], [w[0] for w in down]
    if native_reads(rows, gu[0], dn[0]):
        out = jax.lax.platform_dependent(rows, routing, gu, dn, cpu=experts_native, default=experts_grouped)
    else:
        out = experts_grouped(rows, routing, gu, dn)
    return out.astype(jnp.float32)


def _combine(got: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """float32 [t, H]: each token's k expert outputs got [t * k, H] (float32, 0 where not served) times their
    routing weights [t, k], summed one after another in expert-id order from zero, as the in-memory kernels
    add a token's experts (so the sum is the same float32 number for any k, not only k <= 2)."""
    t, k = weights.shape
    contrib = (got * weights.reshape(-1, 1)).reshape(t, k, -1)
    order = jnp.argsort(experts, axis=1, stable=True)
    contrib = jnp.take_along_axis(contrib, order[:, :, None], axis=1)
    out = jnp.zeros((t, contrib.shape[-1]), jnp.float32)
    for j in range(k):
        out = out + contrib[:, j]
    return out


def _assignments(experts, valid, tables: ReplicaTables, num_devices: int):
    """Per local (token, k) assignment: its token row, whether it is real, its destination device
    (G for padding: nowhere) and slot there. Inside shard_map."""
    t, k = experts.shape
    e = experts.reshape(-1)
    ok = jnp.repeat(valid, k)
    dst, slot = _replica_choice(e, ok, tables, num_devices)
    return jnp.arange(t * k) // k, ok, jnp.where(ok, dst, num_devices), slot


def _padded_body(x, experts, weights, valid, gate_up, down, tables: ReplicaTables, *, capacity: int,
                 num_devices: int):
    t, H, S, G = experts.shape[0], x.shape[-1], len(gate_up), num_devices
    token, ok, dst, slot = _assignments(experts, valid, tables, G)
    onehot = jax.nn.one_hot(dst, G, dtype=jnp.int32)  # [n, G]; row of zeros for dst == G
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    fits = ok & (pos < capacity)
    overflow = jnp.sum(ok & ~fits)
    dst = jnp.where(fits, dst, G)
    send_x = jnp.zeros((G, capacity, H), x.dtype).at[dst, pos].set(x[token], mode="drop")
    send_slot = jnp.full((G, capacity), S, jnp.int32).at[dst, pos].set(slot, mode="drop")
    recv_x = jax.lax.all_to_all(send_x, EP_AXIS, 0, 0, tiled=True)
    recv_slot = jax.lax.all_to_all(send_slot, EP_AXIS, 0, 0, tiled=True)
    y = _local_experts(recv_x.reshape(G * capacity, H), recv_slot.reshape(-1), gate_up, down)
    back = jax.lax.all_to_all(y.reshape(G, capacity, H), EP_AXIS, 0, 0, tiled=True)
    got = back.at[dst, pos].get(mode="fill", fill_value=0)  # float32 [n, H]
    out = _combine(jnp.where(fits[:, None], got, 0.0), weights, experts)
    return out.astype(x.dtype), jax.lax.psum(overflow, EP_AXIS)[None], _slot_rows(recv_slot, S)


def _ragged_body(x, experts, weights, valid, gate_up, down, tables: ReplicaTables, *, capacity: int,
                 num_devices: int, a2a=jax.lax.ragged_all_to_all):
    """Same contract as `_padded_body`; `capacity` bounds the rows one device receives in all.
    `a2a` is `jax.lax.ragged_all_to_all` (tests substitute an emulation where XLA lacks it)."""
    t, H, S, G = experts.shape[0], x.shape[-1], len(gate_up), num_devices
    n = t * experts.shape[1]
    token, ok, dst, slot = _assignments(experts, valid, tables, G)
    order = jnp.argsort(dst, stable=True)  # rows grouped by destination, padding last
    send_sizes = jnp.bincount(dst, length=G).astype(jnp.int32)  # [G]
    sizes = jax.lax.all_gather(send_sizes, EP_AXIS)  # [G src, G dst]
    me = jax.lax.axis_index(EP_AXIS)
    input_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    below = (jnp.arange(G) < me)[:, None]
    output_offsets = jnp.sum(jnp.where(below, sizes, 0), axis=0).astype(jnp.int32)  # where my rows land at each dst
    recv_sizes = sizes[:, me].astype(jnp.int32)
    recv_offsets = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    received = jnp.sum(recv_sizes)
    overflow = jnp.maximum(received - capacity, 0)
    send_x = x[token[order]]
    send_slot = slot[order].astype(jnp.int32)
    recv_x = a2a(send_x, jnp.zeros((capacity, H), x.dtype), input_offsets, send_sizes, output_offsets, recv_sizes,
                 axis_name=EP_AXIS)
    recv_slot = a2a(send_slot, jnp.full((capacity,), S, jnp.int32), input_offsets, send_sizes, output_offsets,
                    recv_sizes, axis_name=EP_AXIS)
    recv_slot = jnp.where(jnp.arange(capacity) < received, recv_slot, S)
    y = _local_experts(recv_x, recv_slot, gate_up, down)
    # the way back: the chunk I received from src returns to src's send offset for me
    back_offsets = jnp.sum(jnp.where((jnp.arange(G) < me)[None, :], sizes, 0), axis=1).astype(jnp.int32)
    back = a2a(y, jnp.zeros((n, H), y.dtype), recv_offsets, recv_sizes, back_offsets, send_sizes, axis_name=EP_AXIS)
    unsorted = jnp.zeros((n, H), jnp.float32).at[order].set(back)
    out = _combine(jnp.where(ok[:, None], unsorted, 0.0), weights, experts)
    return out.astype(x.dtype), jax.lax.psum(overflow, EP_AXIS)[None], _slot_rows(recv_slot, S)


def _slot_rows(recv_slot: jax.Array, num_slots: int) -> jax.Array:
    """int32 [1, S]: the rows this device received per slot (slot S marks padding). Inside shard_map."""
    return jnp.bincount(recv_slot.reshape(-1), length=num_slots + 1)[:num_slots].astype(jnp.int32)[None]


def run_body(body, x, experts, weights, valid, gate_up, down, tables: ReplicaTables, *, mesh: Mesh, capacity: int):
    """One dispatch body under shard_map over the `ep` axis of `mesh` (see `ep_moe`)."""
    rows = P(EP_AXIS)
    fn = jax.shard_map(functools.partial(body, capacity=capacity, num_devices=mesh.shape[EP_AXIS]), mesh=mesh,
                       in_specs=(rows, rows, rows, rows, rows, rows, P()), out_specs=(rows, rows, rows), check_vma=False)
    return fn(x, experts, weights, valid, tuple(gate_up), tuple(down), tables)


@functools.partial(jax.jit, static_argnames=("mesh", "capacity", "dispatch"))
def ep_moe(x: jax.Array, experts: jax.Array, weights: jax.Array, valid: jax.Array, gate_up: tuple,
           down: tuple, tables: ReplicaTables, *, mesh: Mesh, capacity: int, dispatch: Dispatch = Dispatch.padded
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Expert-parallel MoE over the `ep` axis of `mesh`.

    x [T, H], experts int32 [T, k], weights float32 [T, k], valid bool [T] (all sharded over `ep` by
    rows, T = G * t); gate_up: S arrays [G, 2F, H] and down: S arrays [G, H, F], slot s of every
    device, sharded over `ep` (row g lives on device g); tables replicated. Returns the combined
    expert output [T, H] (sharded like x) and the number of assignments that did not fit [G]
    (every entry the same total; 0 when `capacity` sufficed) and int32 [G, S]: the rows slot s of
    device g received, counted on the device. `capacity`: padded, the rows one device sends another
    at most; ragged, the rows one device receives in all.
    """
    body = _padded_body if dispatch is Dispatch.padded else _ragged_body
    return run_body(body, x, experts, weights, valid, gate_up, down, tables, mesh=mesh, capacity=capacity)


def shard_rows(mesh: Mesh, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Place arrays with their first axis split over `ep` (no copy when they already are)."""
    sharding = NamedSharding(mesh, P(EP_AXIS))
    return tuple(jax.device_put(a, sharding) for a in arrays)


def replicate(mesh: Mesh, tree):
    """Place a pytree replicated on every device of `mesh`."""
    return jax.device_put(tree, NamedSharding(mesh, P()))
