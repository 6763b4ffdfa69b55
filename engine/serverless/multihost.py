"""Multi-host expert parallelism: the same EP layer and replica store over `jax.distributed`.

Every host runs the same program; `initialize` joins the processes (before any device is used),
after which `jax.devices()` lists every process's devices and the `ep` mesh spans them all. The
EP layer is unchanged: shard_map's collectives cross hosts. Each process fills only the replica
slots of its own devices (`DeviceReplicaStore`) and keeps the same slot bookkeeping, since the
policies are deterministic functions of the (all-gathered) routing. On CPU the collectives go
through gloo (`jax_cpu_collectives_implementation`).

    # host i of N (real mode):
    python -m engine.serve mode=real serverless=tiny model=tiny_mixtral \\
        distributed.coordinator=host0:1234 distributed.num_processes=N distributed.process_id=i

    # self-check on one machine, two processes of 4 CPU devices each (what tests/test_serve.py runs):
    python -m engine.serverless.multihost --coordinator localhost:12355 --num-processes 2 --process-id 0 &
    python -m engine.serverless.multihost --coordinator localhost:12355 --num-processes 2 --process-id 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join the job (call before any JAX device use)."""
    import jax

    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"distributed: process_id={process_id} must lie in [0, num_processes={num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; GPUs use NCCL
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def maybe_initialize(node: Any) -> bool:
    """Initialize from a serve config's `distributed` block when it names a coordinator."""
    d = getattr(node, "distributed", None)
    if d is None or not d.coordinator:
        return False
    initialize(str(d.coordinator), int(d.num_processes), int(d.process_id))
    return True


def self_check(seed: int = 0) -> dict[str, Any]:
    """Run one EP layer over every process's devices with a MoEless placement (replicated hot
    expert, devices left empty) and compare with a numpy computation of the same layer."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from engine.serverless.ep_layer import EP_AXIS, ReplicaTables, ep_moe, replicate, required_capacity, \
        tables_from_slots
    from engine.serverless.real_serving import ep_mesh
    from engine.serverless.replica_store import DeviceReplicaStore
    from schedulers.serverless.moeless import MoElessPolicy

    mesh = ep_mesh()
    G = int(np.asarray(mesh.devices).size)
    E, H, F, k, S = 6, 16, 24, 2, 2
    T = 4 * G
    rng = np.random.default_rng(seed)  # same seed on every process: same weights, tokens, plan
    gate_up = (0.2 * rng.standard_normal((E, 2 * F, H))).astype(np.float32)
    down = (0.2 * rng.standard_normal((E, H, F))).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    experts = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    experts[: T // 2, 0] = 0  # a hot expert
    weights = rng.random((T, k)).astype(np.float32)
    valid = np.ones(T, bool)
    loads = np.bincount(experts.reshape(-1), minlength=E)
    placement = MoElessPolicy(E, G, S, 1.0).plan(0, loads, None)
    store = DeviceReplicaStore(mesh, list(gate_up), list(down), S)
    update = store.apply(placement)
    tables = replicate(mesh, ReplicaTables(**{key: jnp.asarray(v) for key, v in
                                             tables_from_slots(placement, update.slot_of_replica, G * S).items()}))
    rows = NamedSharding(mesh, P(EP_AXIS))
    glob = lambda a: jax.make_array_from_callback(a.shape, rows, lambda idx: a[idx])
    gu, dn = store.arrays()
    out, overflow, _ = ep_moe(glob(x), glob(experts), glob(weights), glob(valid), gu, dn, tables, mesh=mesh,
                              capacity=max(1, required_capacity(experts, valid, placement)))
    got = np.asarray(multihost_utils.process_allgather(out, tiled=True))
    silu = lambda v: v / (1 + np.exp(-v))
    ref = np.zeros_like(x)
    for t in range(T):
        for j in range(k):
            h = gate_up[experts[t, j]] @ x[t]
            ref[t] += weights[t, j] * (down[experts[t, j]] @ (silu(h[:F]) * h[F:]))
    return {"process": jax.process_index(), "processes": jax.process_count(), "devices": G,
            "local_devices": len(jax.local_devices()), "replicas": placement.num_replicas,
            "hot_expert_replicas": int(placement.replica_counts()[0]),
            "empty_devices": int((placement.replicas_per_device() == 0).sum()),
            "overflow": int(np.asarray(multihost_utils.process_allgather(overflow, tiled=True))[0]),
            "max_abs_err": float(np.abs(got - ref).max())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--local-devices", type=int, default=4, help="host devices per process on CPU")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_devices}"
    initialize(args.coordinator, args.num_processes, args.process_id)
    print(json.dumps(self_check()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
