"""Speculative expert execution (arXiv 2603.19289): the substitution rule, the simulator's timing of it, and the
executor's outputs against the in-memory model run with the same speculation."""

from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest

from engine.offload.speculation import SpeculatingExperts, hit_share, speculated_routing
from predictors.gate import GatePredictor


def test_a_missed_pair_is_computed_by_the_first_speculated_expert_its_token_leaves_free() -> None:
    experts = np.array([[0, 1], [2, 3], [3, -1], [5, 0]])
    assert speculated_routing(experts, [0, 3, 6]).tolist() == [[0, 3], [0, 3], [3, -1], [3, 0]]
    per_token = np.array([[1, 0], [4, 5], [3, 2], [0, 7]])  # one speculation per token (the paper's)
    assert speculated_routing(experts, per_token).tolist() == [[0, 1], [4, 5], [3, -1], [7, 0]]
    assert speculated_routing(experts, [7]).tolist() == [[7, -1], [7, -1], [7, -1], [7, -1]]  # too few: dropped
    assert hit_share(experts, [0, 1, 2, 3, 5]) == 1.0 and hit_share(experts, [0, 3, 6]) == pytest.approx(4 / 7)


@pytest.fixture(scope="module")
def mixtral_b1():
    """Mixtral-8x7B on the A100 profile at batch 1 (the paper's local-deployment regime), 6 decode steps, recorded:
    Fate (the same prefetching, misses loaded on demand) and speculative execution on it."""
    from engine.bench.bench_horizon_study import Point, point_spec
    from engine.bench.bench_simulate_sweep import scheduler_settings
    from engine.sim.run import prepare_routing, simulate

    base = replace(point_spec(Point("sweep", "mixtral_8x7b", "a100_pcie4", 1), 0), prompt_len=64, gen_len=6,
                   check_invariants=True)
    routing = prepare_routing(base)
    return routing, {name: simulate(replace(base, scheduler=scheduler_settings(name)), routing, record=True)
                     for name in ("fate", "speculative")}


def test_simulated_speculation_computes_only_experts_at_hand_and_loads_nothing_on_demand(mixtral_b1) -> None:
    from engine.sim.invariants import check_events

    routing, runs = mixtral_b1
    fate, spec = runs["fate"], runs["speculative"]
    assert spec.summary["decode_latency_s"] < 0.8 * fate.summary["decode_latency_s"]
    decode = {fp.index for fp in routing.passes if not fp.prefill}
    staged = [e for e in spec.sim.events if e.lane == "link" and e.kind == "staged" and e.pass_index in decode]
    assert not staged, "a speculating decode step loaded an expert on demand"
    executed = spec.sim.executed_loads
    assert executed and all(key[0] in decode for key in executed)
    changed = sum(int(np.any(executed[(fp.index, layer)] != fp.loads[layer])) for fp in routing.passes
                  for layer in range(fp.loads.shape[0]) if (fp.index, layer) in executed)
    assert changed > 0, "speculation never replaced a routed expert"
    check_events(spec.sim.events, routing.passes, staging_slots=2, executed=executed)
    with pytest.raises(Exception, match="computed"):  # the routed pairs are not what it computed
        check_events(spec.sim.events, routing.passes, staging_slots=2)


def reference(model, cfg, prompts, new: int, forced: np.ndarray, speculated) -> list[np.ndarray]:
    """Logits [B, V] of the prefill and of each teacher-forced decode step, each MoE layer speculating as the
    executor's plan of that pass did (`speculated`: (pass, MoE layer, experts))."""
    from engine.offload.executor import padded_shapes
    from models.generation import left_pad, pad_id
    from models.transformer import forward, forward_jit, init_cache

    table = {(p, m): s for p, m, s in speculated}
    B, P, capacity = padded_shapes(prompts, new)
    tokens, valid = left_pad(prompts, P, pad_id(cfg.pad_token_id, cfg.eos_token_id))
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    kv = init_cache(model, B, capacity, model.embed[...].dtype)
    step = [0]
    ex = SpeculatingExperts(model, sets=lambda m: table.get((step[0], m)))
    # the prefill never speculates: the compiled model (an eager prefill would compile each op for its shapes)
    logits, kv, _ = forward_jit(model, jnp.asarray(tokens), kv, jnp.asarray(positions), jnp.asarray(valid),
                                last_only=True)
    out = [np.asarray(logits)]
    nxt, pos = forced[:, 0], positions[:, -1] + 1
    for step[0] in range(1, new):
        logits, kv, _ = forward(model, jnp.asarray(nxt[:, None]), kv, jnp.asarray(pos[:, None]),
                                jnp.ones((B, 1), bool), executor=ex, last_only=True)
        out.append(np.asarray(logits))
        nxt, pos = forced[:, step[0]], pos + 1
    return out


def test_executor_speculates_in_decode_only(tiny_mixtral) -> None:
    """Two cache slots per layer, Fate's forecast prefetches (the gate predictor): the prefill's logits are Fate's (exact),
    the first decode step (the same input token in both runs) speculates and moves them. The reference check is slow."""
    from tests.test_offload_executor import _run

    cfg, model, store, prompts, predictors = tiny_mixtral
    spec = _run(cfg, model, store, "speculative", 2 * len(cfg.moe_layers), predictors, prompts, 2)
    fate = _run(cfg, model, store, "fate", 2 * len(cfg.moe_layers), predictors, prompts, 2)
    assert spec.speculated and all(p > 0 for p, _, _ in spec.speculated), "no decode layer speculated (or a prefill did)"
    assert not fate.speculated
    np.testing.assert_allclose(spec.all_logits[0], fate.all_logits[0], atol=1e-5)
    assert float(np.abs(spec.all_logits[1] - fate.all_logits[1]).max()) > 1e-2, "speculation changed nothing"


@pytest.mark.slow
def test_executor_computes_the_speculated_experts_as_the_reference_model(tiny_mixtral) -> None:
    """As above, four decode steps: the executor's logits equal the in-memory model run with the executor's own
    speculation (`SpeculatingExperts`, eager: slow), pass by pass."""
    from tests.test_offload_executor import _run

    cfg, model, store, prompts, predictors = tiny_mixtral
    new = 5
    out = _run(cfg, model, store, "speculative", 2 * len(cfg.moe_layers), predictors, prompts, new)
    assert out.speculated and all(p > 0 for p, _, _ in out.speculated), "no decode layer speculated (or a prefill did)"
    ref = reference(model, cfg, prompts, new, out.tokens, out.speculated)
    for step in range(new):
        np.testing.assert_allclose(out.all_logits[step], ref[step], atol=2e-3, rtol=2e-3, err_msg=f"step {step}")
    exact = reference(model, cfg, prompts, new, out.tokens, [])
    assert float(np.abs(exact[-1] - ref[-1]).max()) > 1e-2, "speculation changed nothing"


@pytest.fixture(scope="module")
def tiny_mixtral():
    from conf import compose
    from engine.offload.store import ExpertStore
    from models.loading import load_model

    cfg, model, _ = load_model(compose("generate", ["model=mixtral_tiny"]).model)
    rs = np.random.RandomState(1)
    prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in (4, 7)]
    # the paper's speculation: the next layer's router on the current hidden state (what Fate prefetches by here)
    return cfg, model, ExpertStore.from_model(model), prompts, {1: GatePredictor.from_model(model, 1)}
