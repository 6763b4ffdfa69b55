"""The shard_map expert-parallel layer, the replica store and the executor on 8 host CPU devices.

References are the models' own single-device expert computation (`models.moe.InMemoryExperts`)
and the in-memory model forward (tests/conftest.py sets 8 host devices before jax is imported).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import functools

from engine.serverless.ep_layer import Dispatch, ReplicaTables, _ragged_body, ep_moe, replicate, required_capacity, \
    resolve_dispatch, run_body, shard_rows, tables_from_slots
from engine.serverless.executor import ServerlessExecutor
from engine.serverless.forecast import LoadForecast
from engine.serverless.policies import SystemSpec
from engine.serverless.replica_store import DeviceReplicaStore
from engine.serverless.slots import Source
from models.config import Family, ModelConfig
from models.moe import DEFAULT_EXECUTOR, InMemoryExperts, RoutedExperts, Routing
from models.transformer import build_model, forward, forward_jit, init_cache
from predictors.gate import GatePredictor
from predictors.historical_load import HistoricalLoadForecaster
from schedulers.ep_placement import Placement, assign_tokens
from schedulers.serverless.eplb import EPLBSettings
from schedulers.serverless.moeless import MoElessSettings
from schedulers.serverless.oracle_balance import OracleBalanceSettings
from schedulers.serverless.static_ep import StaticEPSettings

G, E, H, F, K, S = 8, 6, 16, 32, 2, 3
T = 40  # 5 tokens per device


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    assert len(jax.devices()) >= G, "tests/conftest.py should give 8 host devices"
    return Mesh(np.asarray(jax.devices()[:G]), ("ep",))


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(0)
    experts = RoutedExperts(E, H, F, rngs=__import__("flax").nnx.Rngs(params=1))
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    ids[:24, 0] = 0  # expert 0 is hot
    w = rng.random((T, K)).astype(np.float32)
    valid = np.ones(T, bool)
    valid[[7, 21, 39]] = False  # padding rows
    return experts, x, ids, w, valid


def reference(experts: RoutedExperts, x, ids, w, valid) -> np.ndarray:
    routing = Routing(experts=jnp.asarray(ids), weights=jnp.asarray(w), logits=jnp.zeros((T, E)))
    out = np.asarray(InMemoryExperts(slot_limit=0, dense_limit=0)(0, jnp.asarray(x), routing, experts))
    return np.where(valid[:, None], out, 0.0)


def slots_in_order(p: Placement) -> np.ndarray:
    used: dict[int, int] = {}
    out = []
    for g in p.replica_device.tolist():
        out.append(used.get(g, 0))
        used[g] = out[-1] + 1
    return np.asarray(out)


PLACEMENTS = {
    "one_per_device_two_idle": [(e, e) for e in range(E)],
    "hot_expert_replicated_incl_same_device": [(0, 0), (0, 3), (0, 5), (0, 5), (1, 1), (2, 2), (3, 3), (4, 4), (5, 6)],
    "five_empty_devices": [(0, 2), (0, 6), (1, 2), (2, 2), (3, 6), (4, 6), (5, 4)],
    "crowded_device_hot_elsewhere": [(0, 7), (1, 7), (2, 7), (0, 1), (3, 0), (4, 0), (5, 1)],
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_ep_layer_equals_single_device_reference(mesh, layer, name):
    experts, x, ids, w, valid = layer
    placement = Placement.from_lists(E, G, PLACEMENTS[name])
    slot_of = slots_in_order(placement)
    gate_up, down = experts.arrays()
    gu = np.zeros((S, G, 2 * F, H), np.float32)
    dn = np.zeros((S, G, H, F), np.float32)
    for r, (e, g) in enumerate(zip(placement.replica_expert, placement.replica_device)):
        gu[slot_of[r], g], dn[slot_of[r], g] = np.asarray(gate_up[e]), np.asarray(down[e])
    tables = replicate(mesh, ReplicaTables(**{k: jnp.asarray(v) for k, v in
                                             tables_from_slots(placement, slot_of, G * S).items()}))
    need = required_capacity(ids, valid, placement)
    assert 0 < need <= (T // G) * K
    args = shard_rows(mesh, jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), jnp.asarray(valid))
    args += (shard_rows(mesh, *map(jnp.asarray, gu)), shard_rows(mesh, *map(jnp.asarray, dn)))
    out, overflow, slot_rows = ep_moe(*args, tables, mesh=mesh, capacity=(T // G) * K)  # one compilation for all cases
    assert int(overflow[0]) == 0
    np.testing.assert_allclose(np.asarray(out), reference(experts, x, ids, w, valid), atol=2e-6)
    assert_replicas_got_their_share(np.asarray(slot_rows), placement, slot_of, ids, valid)
    if name == "five_empty_devices":  # one slot short of the busiest device pair: the dropped rows are reported
        _, short, _ = ep_moe(*args, tables, mesh=mesh, capacity=need - 1)
        assert int(short[0]) > 0


def test_ep_layer_rounds_as_the_in_memory_model_in_bf16(mesh, layer):
    """bf16, every expert on one device: the layer's output equals the in-memory experts' bit for bit (the same
    kernels, float32 outputs carried back, one rounding after the weighted sum). Rounding each expert's output to
    bf16 before the combine, as the layer once did, moves some entries by a bf16 step."""
    experts, x, ids, w, valid = layer
    placement = Placement.from_lists(E, G, PLACEMENTS["one_per_device_two_idle"])
    slot_of = slots_in_order(placement)
    gate_up, down = (tuple(a.astype(jnp.bfloat16) for a in arrays) for arrays in experts.arrays())
    gu = [np.zeros((G, 2 * F, H), jnp.bfloat16) for _ in range(S)]
    dn = [np.zeros((G, H, F), jnp.bfloat16) for _ in range(S)]
    for r, (e, g) in enumerate(zip(placement.replica_expert, placement.replica_device)):
        gu[slot_of[r]][g], dn[slot_of[r]][g] = np.asarray(gate_up[e]), np.asarray(down[e])
    tables = replicate(mesh, ReplicaTables(**{k: jnp.asarray(v) for k, v in
                                             tables_from_slots(placement, slot_of, G * S).items()}))
    xb = jnp.asarray(x * 4, jnp.bfloat16)  # larger activations: more entries where a double rounding shows
    args = shard_rows(mesh, xb, jnp.asarray(ids), jnp.asarray(w), jnp.asarray(valid))
    args += (shard_rows(mesh, *map(jnp.asarray, gu)), shard_rows(mesh, *map(jnp.asarray, dn)))
    out, overflow, _ = ep_moe(*args, tables, mesh=mesh, capacity=(T // G) * K)
    assert int(overflow[0]) == 0
    routing = Routing(experts=jnp.asarray(ids), weights=jnp.asarray(w), logits=jnp.zeros((T, E)), valid=jnp.asarray(valid))
    ref = np.asarray(InMemoryExperts()(0, xb, routing, _Arrays(gate_up, down)).astype(jnp.bfloat16), np.float32)
    got = np.asarray(out, np.float32)
    np.testing.assert_array_equal(got[valid], ref[valid])


class _Arrays:
    """Expert weights as the in-memory executor reads them (`arrays()`): the bf16 test's reference experts."""

    def __init__(self, gate_up, down):
        self.gate_up, self.down = list(gate_up), list(down)

    def arrays(self):
        return self.gate_up, self.down


def assert_replicas_got_their_share(slot_rows: np.ndarray, placement: Placement, slot_of: np.ndarray, ids: np.ndarray,
                                    valid: np.ndarray) -> None:
    """The rows each replica received, counted on its device: expert e's W_e rows split over its R_e
    replicas (each floor or ceil of W_e / R_e), exactly as the host reference `assign_tokens` splits them."""
    got = slot_rows[placement.replica_device, slot_of]  # [R]
    want = np.bincount(assign_tokens(ids[valid], placement).reshape(-1), minlength=placement.num_replicas)
    assert got.tolist() == want.tolist()
    loads = np.bincount(ids[valid].reshape(-1), minlength=placement.num_experts)
    counts = placement.replica_counts()
    for e in range(placement.num_experts):
        share = got[placement.replica_expert == e]
        assert share.sum() == loads[e] and share.max() - share.min() <= 1, (e, share.tolist())
        assert share.min() >= loads[e] // counts[e]
    assert slot_rows.sum() == loads.sum()  # nothing else arrived anywhere


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all` from padded all_to_all (XLA:CPU has no ragged one): rows
    input_offsets[g] + i (i < send_sizes[g]) go to device g, landing at its row output_offsets[g] + i."""
    N, G = operand.shape[0], send_sizes.shape[0]
    i = jnp.arange(N)
    live = i[None, :] < send_sizes[:, None]  # [G, N]
    rows = jnp.clip(input_offsets[:, None] + i[None, :], 0, N - 1)
    chunks = jnp.where(live.reshape(live.shape + (1,) * (operand.ndim - 1)), operand[rows], 0)
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [G src, N, ...]
    where = jax.lax.all_to_all(output_offsets[:, None], axis_name, 0, 0, tiled=True)[:, 0]  # src's offset for me
    target = jnp.where(i[None, :] < recv_sizes[:, None], where[:, None] + i[None, :], output.shape[0])
    return output.at[target].set(got, mode="drop")


@pytest.mark.parametrize("name", ["five_empty_devices",
                                  pytest.param("hot_expert_replicated_incl_same_device", marks=pytest.mark.slow)])
def test_ragged_dispatch_equals_the_reference(mesh, layer, name):
    """The ragged path's offsets, run through an emulated ragged_all_to_all."""
    experts, x, ids, w, valid = layer
    placement = Placement.from_lists(E, G, PLACEMENTS[name])
    slot_of = slots_in_order(placement)
    gate_up, down = experts.arrays()
    gu = [np.zeros((G, 2 * F, H), np.float32) for _ in range(S)]
    dn = [np.zeros((G, H, F), np.float32) for _ in range(S)]
    for r, (e, g) in enumerate(zip(placement.replica_expert, placement.replica_device)):
        gu[slot_of[r]][g], dn[slot_of[r]][g] = np.asarray(gate_up[e]), np.asarray(down[e])
    tables = replicate(mesh, ReplicaTables(**{k: jnp.asarray(v) for k, v in
                                             tables_from_slots(placement, slot_of, G * S).items()}))
    need = required_capacity(ids, valid, placement, Dispatch.ragged)
    args = shard_rows(mesh, jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), jnp.asarray(valid))
    args += (shard_rows(mesh, *map(jnp.asarray, gu)), shard_rows(mesh, *map(jnp.asarray, dn)))
    body = functools.partial(_ragged_body, a2a=emulated_ragged_all_to_all)
    out, overflow, slot_rows = jax.jit(functools.partial(run_body, body, mesh=mesh, capacity=need))(*args, tables)
    assert int(overflow[0]) == 0
    np.testing.assert_allclose(np.asarray(out), reference(experts, x, ids, w, valid), atol=2e-6)
    assert_replicas_got_their_share(np.asarray(slot_rows), placement, slot_of, ids, valid)
    _, short, _ = jax.jit(functools.partial(run_body, body, mesh=mesh, capacity=need - 1))(*args, tables)
    assert int(short[0]) >= 1  # a row past the busiest receiver's buffer is reported


def test_required_capacity_counts_the_busiest_device_pair():
    placement = Placement.from_lists(2, 2, [(0, 0), (1, 1)])
    ids = np.array([[0], [0], [0], [1]], np.int32)  # device 0 rows: 0, 0 -> dev 0 twice; device 1 rows: 0, 1
    assert required_capacity(ids, np.ones(4, bool), placement) == 2
    assert required_capacity(ids, np.array([True, False, True, True]), placement) == 1
    assert required_capacity(ids, np.ones(4, bool), placement, Dispatch.ragged) == 3  # device 0 receives three
    rep = assign_tokens(np.array([[0], [0], [0]]), Placement.from_lists(2, 2, [(0, 0), (0, 1), (1, 1)]))
    assert rep[:, 0].tolist() == [0, 1, 0]


def test_dispatch_mode_follows_the_backend():
    assert resolve_dispatch(Dispatch.auto, "cpu") is Dispatch.padded
    assert resolve_dispatch(Dispatch.auto, "gpu") is Dispatch.ragged
    with pytest.raises(ValueError, match="ragged_all_to_all is not implemented on XLA:CPU"):
        resolve_dispatch(Dispatch.ragged, "cpu")


def test_replica_store_reuses_live_replicas_and_counts_copies(mesh, layer):
    experts, *_ = layer
    gate_up, down = experts.arrays()
    store = DeviceReplicaStore(mesh, gate_up, down, slots_per_device=2)
    first = Placement.from_lists(E, G, [(e, e) for e in range(E)] + [(0, 7)])
    up = store.apply(first)
    assert up.count(Source.host) == 7 and store.bytes == {"host": 7 * store.expert_bytes, "peer": 0}
    # expert 0 moves from devices {0, 7} to {0, 6}; expert 5 gains a replica on device 4
    second = Placement.from_lists(E, G, [(e, e) for e in range(E)] + [(0, 6), (5, 4)])
    up2 = store.apply(second)
    assert up2.count(Source.warm) == 6 and up2.count(Source.peer) == 2 and up2.count(Source.host) == 0
    assert store.bytes["peer"] == 2 * store.expert_bytes
    gu, dn = store.arrays()
    assert len(gu) == 2 and gu[0].shape == (G, 2 * F, H) and len(gu[0].sharding.device_set) == G
    contents = store.slot_contents()
    for g in range(G):
        for s in range(2):
            if contents[g, s] >= 0:
                np.testing.assert_array_equal(np.asarray(gu[s])[g], np.asarray(gate_up[contents[g, s]]))
                np.testing.assert_array_equal(np.asarray(dn[s])[g], np.asarray(down[contents[g, s]]))
    assert contents[7].tolist().count(0) == 1  # the replica on device 7 is kept alive (idle), not erased
    assert store.live().pairs() == sorted(second.pairs() + [(0, 7)])


# ---- the executor inside the model forward ----------------------------------------------------


def tiny_cfg() -> ModelConfig:
    return ModelConfig(family=Family.mixtral, vocab_size=97, hidden_size=32, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, num_experts=8,
                       num_experts_per_tok=2, max_position_embeddings=64)


def run_model(model, executor, tokens, positions, valid, decode: bool = True):
    """Prefill (+ one decode step); the in-memory reference runs compiled, the serverless executor
    eagerly (its decisions are host code between layers)."""
    fwd = forward_jit if executor is DEFAULT_EXECUTOR else forward
    cache = init_cache(model, tokens.shape[0], 16)
    logits, cache, _ = fwd(model, jnp.asarray(tokens), cache, jnp.asarray(positions), jnp.asarray(valid),
                           executor=executor)
    if not decode:
        return np.asarray(logits), None
    step = np.full((tokens.shape[0], 1), 5, np.int32)
    logits2, _, _ = fwd(model, jnp.asarray(step), cache, jnp.asarray(positions[:, -1:] + 1),
                        jnp.asarray(valid[:, -1:]), executor=executor)
    return np.asarray(logits), np.asarray(logits2)


@pytest.mark.parametrize("kind", ["moeless", "static_ep", pytest.param("eplb", marks=pytest.mark.slow),
                                  pytest.param("oracle", marks=pytest.mark.slow)])
def test_executor_output_equals_the_in_memory_model(mesh, kind):
    cfg = tiny_cfg()
    model = build_model(cfg, seed=3)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, size=(8, 5)).astype(np.int32)
    valid = np.ones((8, 5), bool)
    valid[6:, :2] = False  # left padding on two rows
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    ref = run_model(model, DEFAULT_EXECUTOR, tokens, positions, valid)
    predictor = GatePredictor.from_model(model, 1)
    spec = SystemSpec({"moeless": MoElessSettings(label=kind, cv_threshold=0.05, capacity_slots=3),
                       "static_ep": StaticEPSettings(label=kind), "oracle": OracleBalanceSettings(label=kind),
                       "eplb": EPLBSettings(label=kind, num_redundant=8, rebalance_interval_s=0.0)}[kind])
    forecast = LoadForecast(predictor, HistoricalLoadForecaster(len(cfg.moe_layers), cfg.num_experts), cfg.num_experts_per_tok)
    exe = ServerlessExecutor(cfg, mesh, spec, forecast, capacity_multiple=16)  # one dispatch capacity: few compiles
    exe.begin_pass(0.0)
    first = run_model(model, exe, tokens, positions, valid, decode=False)
    exe.begin_pass(1.0)
    got = run_model(model, exe, tokens, positions, valid)  # a second pass: warm replicas, forecasts in use
    real = valid[:, -1]
    if kind == "oracle":  # lossy: the routing is replaced
        assert not np.allclose(got[0][real], ref[0][real], atol=1e-3)
        return
    np.testing.assert_allclose(first[0][valid], ref[0][valid], atol=3e-5)
    np.testing.assert_allclose(got[0][valid], ref[0][valid], atol=3e-5)
    np.testing.assert_allclose(got[1][real], ref[1][real], atol=3e-5)
    summary = exe.summary()
    assert summary["layer_calls"] == 3 * len(cfg.moe_layers)
    if kind == "moeless":
        assert summary["forecast_from_predictor"] == 2 / 3  # layers 1, 2 of every pass planned from the gate copies
        assert predictor.hit_rate() > 0  # the forecasts were scored against the routing that followed
        assert summary["mean_replicas"] > cfg.num_experts  # V = 0.05 forces replicas
        assert summary["copies_host"] + summary["copies_peer"] > 0
    if kind == "static_ep":
        assert summary["copies_peer"] == 0 and summary["copies_host"] == len(cfg.moe_layers) * cfg.num_experts
    split = 0
    for rec in exe.records:  # the loads the devices reported (inside shard_map): every replica its even share
        assert rec.replica_loads.sum() == rec.loads.sum() == rec.device_loads.sum()
        for e in range(cfg.num_experts):
            share = rec.replica_loads[rec.replica_expert == e]
            assert share.sum() == rec.loads[e] and share.max() - share.min() <= 1, (rec.layer, e, share.tolist())
            split += int(share.size > 1 and rec.loads[e] >= share.size)
    if kind == "moeless":
        assert split > 0  # some replicated expert had tokens for each of its replicas
