"""Expert Deferral (kTransformers, SOSP'25): which pairs are deferred, the simulator's CPU lane, and the executor's
deferred outputs against the in-memory model run with the same deferral."""

from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest

from engine.offload.deferral import DeferringExperts, deferred_pairs
from schedulers.base import LayerPlan, LayerState, Phase
from tests.test_presched import mixtral


def test_deferred_pairs_are_each_tokens_lowest_weight_cpu_pairs_never_its_top_one() -> None:
    experts = np.array([[0, 1, 2], [3, 1, -1], [2, 0, 1], [4, 5, 6]])
    weights = np.array([[.5, .2, .3], [.6, .4, 0.], [.15, .05, .8], [.2, .3, .5]])
    every = deferred_pairs(experts, weights, range(8), 1)
    assert every.tolist() == [[False, True, False], [False, True, False], [False, True, False], [True, False, False]]
    # only CPU experts: row 0 defers expert 2 (expert 1 is on the GPU), row 2 expert 2 (0 is on the GPU)
    assert deferred_pairs(experts, weights, [2, 3, 4, 5], 1).tolist() == \
        [[False, False, True], [False, False, False], [True, False, False], [True, False, False]]
    # at most k - 1 per token, whatever the knob; the padding slot (-1) never
    many = deferred_pairs(experts, weights, range(8), 5)
    assert many.sum(1).tolist() == [2, 1, 2, 2] and not many[1, 2]
    assert not deferred_pairs(experts, weights, range(8), 0).any()


def test_a_plan_may_not_defer_at_the_last_layer_or_without_cpu_experts() -> None:
    from schedulers.cost import CostModel
    from schedulers.hardware import load_hardware

    tokens = np.array([1, 1, 0, 0, 0, 0, 0, 0], np.int64)
    state = LayerState(layer=3, num_layers=4, phase=Phase.decode, tokens=tokens, scores=tokens * 0.5, predicted={},
                       resident=np.zeros((4, 8), bool), inflight=(), queued=(), alpha_s=0.0, cache_slots=4,
                       free_slots=4, batch_tokens=1, context_len=8, hit_rate={},
                       cost=CostModel(mixtral(), load_hardware("a100_pcie4")), t_io_s=1e-3, t_attn_next_s=1e-3)
    with pytest.raises(ValueError, match="defer=1"):
        LayerPlan(cpu=(0, 1), defer=1).validate(state)
    LayerPlan(cpu=(0, 1), defer=1).validate(replace(state, layer=2))
    # kTransformers defers only in decode, below the last layer, and only where some expert runs on the CPU
    from schedulers.base import SchedulerSetup, build_scheduler
    from schedulers.offload.ktransformers import KTransformersSettings

    sched = build_scheduler(KTransformersSettings(max_deferred_per_token=1, hot_table=False),
                            SchedulerSetup(4, 8, 2, 4, state.cost))
    at = replace(state, layer=2)
    assert sched.plan(at).defer == 1 and sched.plan(state).defer == 0
    assert sched.plan(replace(at, phase=Phase.prefill)).defer == 0
    resident = np.zeros((4, 8), bool)
    resident[2, :2] = True
    assert sched.plan(replace(at, resident=resident)).defer == 0  # both experts on the GPU: nothing to defer


@pytest.fixture(scope="module")
def mixtral_b1():
    """Mixtral-8x7B on the A100 profile at batch 1 (the regime kTransformers targets), 6 decode steps, recorded."""
    from engine.bench.bench_horizon_study import Point, point_spec
    from engine.bench.bench_simulate_sweep import scheduler_settings
    from engine.sim.run import prepare_routing, simulate

    base = replace(point_spec(Point("sweep", "mixtral_8x7b", "a100_pcie4", 1), 0), prompt_len=64, gen_len=6,
                   check_invariants=True)
    routing = prepare_routing(base)
    return {name: simulate(replace(base, scheduler=scheduler_settings(name)), routing, record=True)
            for name in ("ktransformers", "ktransformers_deferral")}


def test_simulated_deferral_keeps_the_cpu_busy_across_layers_on_one_serial_lane(mixtral_b1) -> None:
    plain, deferred = mixtral_b1["ktransformers"], mixtral_b1["ktransformers_deferral"]
    # the CPU works while the GPU runs the next layer's attention: each decode step is shorter
    assert deferred.summary["decode_latency_s"] < 0.95 * plain.summary["decode_latency_s"]
    events = deferred.sim.events
    late = [e for e in events if e.lane == "cpu" and e.kind == "deferred" and e.end > e.start]
    assert late, "no pair was deferred"
    assert not any(e.kind == "deferred" for e in plain.sim.events)
    cpu = sorted((e for e in events if e.lane == "cpu" and e.end > e.start), key=lambda e: e.start)
    assert all(a.end <= b.start + 1e-12 for a, b in zip(cpu, cpu[1:])), "the CPU lane ran two experts at once"
    attn = {(e.pass_index, e.layer): e for e in events if e.kind == "attn"}
    overlapped = 0
    for e in late:
        nxt = attn[(e.pass_index, e.layer + 1)]
        overlapped += e.start < nxt.end  # computed while the next layer's attention runs
        after = attn.get((e.pass_index, e.layer + 2))
        if after is not None:  # added with layer l+1's output: layer l+1 ends (l+2 starts) no earlier
            assert e.end <= after.start + 1e-12
    assert overlapped == len(late)
    assert max(e.layer for e in late) < deferred.sim.L - 1  # the last MoE layer defers nothing


@pytest.fixture(scope="module")
def tiny():
    from conf import compose
    from engine.offload.store import ExpertStore
    from models.loading import load_model

    cfg, model, _ = load_model(compose("generate", ["model=mixtral_tiny"]).model)
    rs = np.random.RandomState(1)
    prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in (7, 12)]
    return cfg, model, ExpertStore.from_model(model), prompts


def reference(model, cfg, prompts, new: int, per_token: int, forced: np.ndarray) -> list[np.ndarray]:
    """Logits [B, V] of the prefill (exact) and of each teacher-forced decode step with every expert deferring."""
    from engine.offload.executor import padded_shapes
    from models.generation import left_pad, pad_id
    from models.transformer import forward, init_cache

    B, P, capacity = padded_shapes(prompts, new)
    tokens, valid = left_pad(prompts, P, pad_id(cfg.pad_token_id, cfg.eos_token_id))
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    kv = init_cache(model, B, capacity, model.embed[...].dtype)
    ex = DeferringExperts(cfg, per_token)
    ex.enabled = False  # the executor defers in decode steps only
    logits, kv, _ = forward(model, jnp.asarray(tokens), kv, jnp.asarray(positions), jnp.asarray(valid), executor=ex,
                            last_only=True)
    out = [np.asarray(logits)]
    ex.enabled = True
    nxt, pos = forced[:, 0], positions[:, -1] + 1
    for step in range(1, new):
        logits, kv, _ = forward(model, jnp.asarray(nxt[:, None]), kv, jnp.asarray(pos[:, None]),
                                jnp.ones((B, 1), bool), executor=ex, last_only=True)
        out.append(np.asarray(logits))
        nxt, pos = forced[:, step], pos + 1
    return out


def test_executor_defers_in_decode_only_and_only_cpu_experts(tiny) -> None:
    """Every expert on the CPU (kTransformers with no hot table, no decode loads): one deferred expert per token leaves
    the prefill's logits as they are and moves the first decode step's (which reads the same tokens in both runs)."""
    from tests.test_offload_executor import _run

    cfg, model, store, prompts = tiny
    L, new = len(cfg.moe_layers), 3
    exact = _run(cfg, model, store, "ktransformers", L, {}, prompts, new, hot_table=False)
    late = _run(cfg, model, store, "ktransformers", L, {}, prompts, new, hot_table=False, max_deferred_per_token=1)
    np.testing.assert_allclose(late.all_logits[0], exact.all_logits[0], atol=1e-5)
    assert float(np.abs(late.all_logits[1] - exact.all_logits[1]).max()) > 1e-2, "deferral changed nothing"


@pytest.mark.slow
def test_executor_adds_deferred_outputs_one_layer_late_as_the_reference_model(tiny) -> None:
    """Every expert on the CPU: the executor's logits with one deferred expert per token equal the in-memory model's
    run with the same deferral (`DeferringExperts`, eager: slow), pass by pass."""
    from tests.test_offload_executor import _run

    cfg, model, store, prompts = tiny
    L, new = len(cfg.moe_layers), 4
    late = _run(cfg, model, store, "ktransformers", L, {}, prompts, new, hot_table=False, max_deferred_per_token=1)
    assert late.checked.plans > 0
    ref = reference(model, cfg, prompts, new, 1, late.tokens)  # fed the tokens the deferring executor chose
    assert len(late.all_logits) == len(ref) == new
    for step in range(new):
        np.testing.assert_allclose(late.all_logits[step], ref[step], atol=2e-3, rtol=2e-3, err_msg=f"step {step}")
