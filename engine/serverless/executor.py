"""`ServerlessExecutor`: the model's MoE layers run expert-parallel with the policy's replicas.

An `ExpertExecutor` (models/moe.py) for an eagerly run forward (the per-layer decisions are host
code between layers, as in MoEless, where scaling and placement run asynchronously beside the
model). At MoE layer l of a forward pass:

1. the placement planned for l (from the forecast made at layer l - d, or from history for the
   first d layers) is applied to l's replica slots: warm replicas stay, cold ones are copied in;
2. the layer runs with `ep_moe` over the `ep` mesh axis (tokens data-parallel, experts in slots);
3. the load forecast for layer l + d is made from l's gate input and routing, and the policy plans
   l + d right away (its slots are filled when l + d runs);
4. the policy and the history observe l's real loads.

Outputs equal the single-device model's for every non-lossy policy (tested); the Oracle re-routes
tokens (`balanced_reroute`) and changes them, as the paper's Oracle does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from engine.serverless.ep_layer import Dispatch, ReplicaTables, ep_moe, replicate, required_capacity, \
    resolve_dispatch, shard_rows, tables_from_slots
from engine.serverless.forecast import LoadForecast
from engine.serverless.policies import SystemSpec, build_policy, slots_per_device
from engine.serverless.replica_store import DeviceReplicaStore
from engine.serverless.slots import Source
from models.config import ModelConfig
from models.moe import RoutedExperts, Routing
from predictors.base import LayerContext
from schedulers.ep_placement import Placement, balancedness
from schedulers.serverless.oracle_balance import balanced_reroute


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def to_host(a: jax.Array) -> np.ndarray:
    """A (possibly multi-host sharded) array as one numpy array on every process."""
    if jax.process_count() > 1 and isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)


@dataclass
class LayerRecord:
    step: int
    layer: int  # MoE-layer index
    tokens: int
    replicas: int
    loads: np.ndarray  # int [E] the experts served (re-routed for the Oracle)
    forecast_used: str  # "predictor" / "history"
    device_loads: np.ndarray  # int [G] rows each device's replicas received, counted on the devices
    replica_loads: np.ndarray  # int [R] rows each replica of the placement received, counted on the devices
    replica_expert: np.ndarray  # int [R] the expert of each replica
    balancedness: float
    copies_host: int
    copies_peer: int
    capacity: int
    wall_s: float  # ep_moe call, including dispatch and combine


class ServerlessExecutor:
    """Runs every MoE layer expert-parallel over the `ep` axis of `mesh`, planned by a policy."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, spec: SystemSpec, forecast: LoadForecast,
                 dispatch: Dispatch = Dispatch.auto, capacity_multiple: int = 8):
        self.cfg = cfg
        self.mesh = mesh
        self.spec = spec
        self.num_devices = int(np.asarray(mesh.devices).size)
        self.moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}
        self.num_layers = len(cfg.moe_layers)
        self.policy = build_policy(spec, cfg.num_experts, self.num_devices, float(cfg.expert_bytes()))
        self.slots = slots_per_device(spec, cfg.num_experts, self.num_devices)
        self.forecast = forecast
        self.dispatch = resolve_dispatch(dispatch, jax.devices()[0].platform)
        self.capacity_multiple = capacity_multiple
        self.stores: dict[int, DeviceReplicaStore] = {}
        self.planned: dict[int, tuple[Placement, str]] = {}
        self.pending_ctx: dict[int, LayerContext] = {}
        self.records: list[LayerRecord] = []
        self.step = -1
        self.now_s = 0.0

    def begin_pass(self, now_s: float = 0.0) -> None:
        """Start a forward pass (one serving iteration) at trace time `now_s`."""
        self.step += 1
        self.now_s = float(now_s)
        self.pending_ctx.clear()

    def _store(self, li: int, experts: Optional[RoutedExperts]) -> DeviceReplicaStore:
        if li not in self.stores:
            if experts is None:
                raise ValueError(f"serverless executor: MoE layer {li} has no expert weights to serve from")
            gate_up, down = experts.arrays()
            self.stores[li] = DeviceReplicaStore(self.mesh, [to_host(w) for w in gate_up], [to_host(w) for w in down],
                                                 self.slots)
        return self.stores[li]

    def _plan(self, li: int, forecast: np.ndarray) -> Placement:
        live = self.stores[li].live() if li in self.stores else None
        return self.policy.plan(li, forecast, live, self.now_s)

    def __call__(self, layer: int, x: jax.Array, routing: Routing, experts: Optional[RoutedExperts]) -> jax.Array:
        li = self.moe_index[layer]
        store = self._store(li, experts)
        ex = to_host(routing.experts).astype(np.int32)
        T, k = ex.shape
        valid = np.ones(T, bool) if routing.valid is None else to_host(routing.valid).astype(bool)
        n_valid = int(valid.sum())
        actual = np.bincount(ex[valid].reshape(-1), minlength=self.cfg.num_experts)
        if li in self.planned:
            placement, used = self.planned.pop(li)
        else:
            placement, used = self._plan(li, self.forecast.from_history(li, n_valid)), "history"
        served = ex
        if self.policy.lossy:
            served = ex.copy()
            served[valid] = balanced_reroute(n_valid, k, self.cfg.num_experts).astype(np.int32)
        placement.check_serves(np.bincount(served[valid].reshape(-1), minlength=self.cfg.num_experts))
        update = store.apply(placement)
        G = self.num_devices
        pad = G * _pow2(-(-T // G)) - T  # shapes bucketed to powers of two: few recompilations
        tokens, exp_p, wts, val = x, served, routing.weights, valid
        if pad:
            tokens = jnp.concatenate([jnp.asarray(x), jnp.zeros((pad, x.shape[-1]), x.dtype)])
            exp_p = np.concatenate([served, np.zeros((pad, k), np.int32)])
            wts = jnp.concatenate([jnp.asarray(routing.weights), jnp.zeros((pad, k), routing.weights.dtype)])
            val = np.concatenate([valid, np.zeros(pad, bool)])
        need = required_capacity(exp_p, val, placement, self.dispatch)
        capacity = max(self.capacity_multiple, _pow2(need))
        tables = replicate(self.mesh, ReplicaTables(**{key: jnp.asarray(v) for key, v in tables_from_slots(
            placement, update.slot_of_replica, G * self.slots).items()}))
        gate_up, down = store.arrays()
        xs, es, ws, vs = shard_rows(self.mesh, tokens, jnp.asarray(exp_p), jnp.asarray(wts, jnp.float32), jnp.asarray(val))
        t0 = time.perf_counter()
        out, overflow, slot_rows = ep_moe(xs, es, ws, vs, gate_up, down, tables, mesh=self.mesh, capacity=capacity,
                                          dispatch=self.dispatch)
        out.block_until_ready()
        wall = time.perf_counter() - t0
        slot_rows = np.asarray(to_host(slot_rows))  # [G, S] measured inside shard_map
        if int(to_host(overflow)[0]):
            raise RuntimeError(f"serverless executor: layer {li}: {int(to_host(overflow)[0])} assignments exceeded "
                               f"the dispatch capacity {capacity}")
        self._forecast_ahead(li, x, routing, ex, valid)
        # the forecast made d layers ago for this layer: scored row by row, unless the layer routes other tokens than
        # it was made for (a prefill's last decoder layer runs each row's last token only: `trims_last_layer`)
        ctx = self.pending_ctx.pop(li, None)
        if ctx is not None and len(ctx.experts) == n_valid:
            self.forecast.predictor.observe(li, ctx, ex[valid].astype(np.int64))
        self.policy.observe(li, actual, self.now_s)
        self.forecast.history.observe(li, actual)
        served_loads = np.bincount(served[valid].reshape(-1), minlength=self.cfg.num_experts)
        dev = slot_rows.sum(axis=1)
        rep = slot_rows[placement.replica_device, update.slot_of_replica]
        self.records.append(LayerRecord(step=self.step, layer=li, tokens=n_valid, replicas=placement.num_replicas,
                                        loads=served_loads, forecast_used=used, device_loads=dev, replica_loads=rep,
                                        replica_expert=placement.replica_expert.copy(), balancedness=balancedness(dev),
                                        copies_host=update.count(Source.host),
                                        copies_peer=update.count(Source.peer), capacity=capacity, wall_s=wall))
        result = out[:T] if pad else out
        return result.astype(x.dtype)

    def _forecast_ahead(self, li: int, x: jax.Array, routing: Routing, ex: np.ndarray, valid: np.ndarray) -> None:
        predictor = self.forecast.predictor
        if predictor is None or self.spec.forecast.value == "history":
            return
        target = li + predictor.distance
        if target >= self.num_layers:
            return
        rows = np.flatnonzero(valid)
        ctx = LayerContext(layer=li, step=self.step, experts=ex[rows], weights=to_host(routing.weights)[rows],
                           hidden=to_host(x).astype(np.float32)[rows])
        forecast = self.forecast.from_predictor(ctx)
        self.planned[target] = (self._plan(target, forecast), "predictor")
        self.pending_ctx[target] = ctx

    def summary(self) -> dict:
        if not self.records:
            return {}
        recs = self.records
        return {"layer_calls": len(recs), "mean_replicas": float(np.mean([r.replicas for r in recs])),
                "mean_balancedness": float(np.mean([r.balancedness for r in recs])),
                "copies_host": int(sum(r.copies_host for r in recs)), "copies_peer": int(sum(r.copies_peer for r in recs)),
                "bytes_host": int(sum(s.bytes["host"] for s in self.stores.values())),
                "bytes_peer": int(sum(s.bytes["peer"] for s in self.stores.values())),
                "mean_layer_wall_ms": float(np.mean([r.wall_s for r in recs]) * 1e3),
                # measured on the devices: the largest gap between two replicas of one expert (1 at most when
                # every replica gets its even share)
                "max_replica_share_gap": int(max((np.ptp(r.replica_loads[r.replica_expert == e])
                                                  for r in recs for e in np.unique(r.replica_expert)), default=0)),
                "forecast_from_predictor": float(np.mean([r.forecast_used == "predictor" for r in recs]))}

