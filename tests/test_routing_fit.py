"""Routing that resembles real routing (issues 20.3 / 21.5) and predictors replayed on recorded routing (21.4):
the fitted synthetic defaults, context caps derived from the recording model, cached recordings, and a
shallow recorded model's predictor driving a deeper simulated model's forecasts."""

from __future__ import annotations


import numpy as np
import pytest

from core.routing_stats import routing_report
from core.trace import RoutingTrace
from engine.serverless.forecast import TiledPredictor
from engine.serverless.model_routing import context_caps
from engine.serverless.serving_trace import ServingTrace, from_routing_trace
from engine.serverless.simulator import forecast_loads
from engine.sim.routing import tile_layers
from engine.synthetic_routing import SyntheticRouter, SyntheticRoutingParams
from predictors.oracle import NoisyOraclePredictor


def test_default_synthetic_routing_has_real_mixtral_statistics_on_a_held_out_seed() -> None:
    # Mixtral-8x7B shape; model seed 12 / traffic seed 9 were not used by the fit (seeds 0-1 / 1)
    trace = SyntheticRouter(32, 8, 2, SyntheticRoutingParams(), model_seed=12).trace(16, 64, 32, seed=9, num_batches=4)
    s = routing_report(trace, distances=(1,))["summary"]
    # real Mixtral-8x7B (vLLM logs): CV 0.22 (0.06-0.34 per layer), transition 0.35-0.40, frequency 0.26-0.31
    assert 0.15 <= s["cv_mean"] <= 0.30, s["cv_mean"]
    assert 0.34 <= s["hit_transition_d1_mean"] <= 0.42, s["hit_transition_d1_mean"]
    assert 0.25 <= s["hit_frequency_d1_mean"] <= 0.34, s["hit_frequency_d1_mean"]
    assert s["hit_transition_d1_mean"] > s["hit_frequency_d1_mean"] + 0.03  # layer l tells about layer l+1


@pytest.mark.parametrize("positions, cap_ctx, cap_gen, want", [
    (1024, None, None, (768, 256)),  # outputs keep a quarter of the positions, prompts the rest
    (1024, 128, 32, (128, 32)),  # tighter configured caps are kept
    (1024, None, 600, (768, 256)),
    (1024, 5000, 8, (1016, 8)),  # a short output cap leaves the prompt the other positions
    (2, None, None, (1, 1)),
])
def test_context_caps_fit_every_request_in_the_model(positions, cap_ctx, cap_gen, want) -> None:
    ctx, gen = context_caps(positions, cap_ctx, cap_gen)
    assert (ctx, gen) == want and ctx + gen <= positions and ctx >= 1 and gen >= 1


def recorded_trace(layers: int = 4) -> RoutingTrace:
    return SyntheticRouter(layers, 8, 2, SyntheticRoutingParams(), model_seed=3).trace(4, 6, 5, seed=2, num_batches=3)


def tiled(st: ServingTrace, layers: int) -> ServingTrace:
    """`st` with its MoE layers cycled to `layers` (rows and steps unchanged), as engine.serve replays it."""
    return ServingTrace(routing=tile_layers(st.routing, layers), time_s=st.time_s, weight=st.weight, phase=st.phase,
                        batch=st.batch, num_seqs=st.num_seqs, context=st.context)


@pytest.mark.parametrize("distance", [1, 2])
def test_a_recorded_models_predictor_forecasts_only_its_own_layer_pairs_on_a_deeper_model(distance: int) -> None:
    replayed = from_routing_trace(recorded_trace(4), decode_stride=2)  # 4 recorded MoE layers
    st = tiled(replayed, 10)  # simulated layers 0..9 replay recorded 0,1,2,3,0,1,...
    # the exact forecaster of the recorded model (hit rate 1): what it forecasts must be the truth
    pred = TiledPredictor(NoisyOraclePredictor(replayed.routing, distance, 1.0), 4)
    out, hits = forecast_loads(st, pred)
    covered = [l for l in range(distance, 10) if (l - distance) % 4 + distance < 4]
    assert sorted(int(l) for l in hits) == covered and all(h == 1.0 for h in hits.values())
    for l in covered:
        assert np.array_equal(out[:, l], st.loads[:, l].astype(np.float32)), l
    # across a cycle's end (recorded layer 3 -> 0) there is no model pair: history, which misses somewhere
    crossing = [l for l in range(distance, 10) if l not in covered]
    assert crossing and any(not np.array_equal(out[:, l], st.loads[:, l]) for l in crossing)


def test_gate_copies_read_the_recorded_gate_inputs_of_their_own_source_layer() -> None:
    """A recorded trace whose layer j routes by a known gate on layer j - 1's gate input: the gate copies,
    replayed on 10 cycled layers, must read the right recorded layer's inputs row by row and hit exactly."""
    from models.config import Family, ModelConfig
    from predictors.base import topk_experts
    from predictors.gate import GatePredictor

    R, H, E = 4, 16, 8
    cfg = ModelConfig(family=Family.mixtral, vocab_size=16, hidden_size=H, intermediate_size=16, num_hidden_layers=R,
                      num_attention_heads=2, num_key_value_heads=1, num_experts=E, num_experts_per_tok=2)
    rng = np.random.default_rng(0)
    base = recorded_trace(R)
    hidden = rng.standard_normal((R, base.num_rows, H)).astype(np.float16)
    kernels = {j: rng.standard_normal((H, E)).astype(np.float32) for j in range(1, R)}
    experts = base.experts.copy()
    for j in range(1, R):  # layer j's router, seen from layer j - 1's gate input
        experts[j] = topk_experts(hidden[j - 1].astype(np.float32) @ kernels[j], 2)
    from dataclasses import replace
    replayed = from_routing_trace(replace(base, experts=experts, hidden=hidden), decode_stride=2)
    gate = GatePredictor("gate", 1, cfg, kernels, {j: np.zeros(E, np.float32) for j in range(1, R)})
    pred = TiledPredictor(gate, R, replayed.routing.hidden)
    _, hits = forecast_loads(tiled(replayed, 10), pred)
    assert sorted(int(l) for l in hits) == [1, 2, 3, 5, 6, 7, 9] and all(h == 1.0 for h in hits.values()), hits


def test_the_tiled_predictor_refuses_a_pair_across_the_cycle() -> None:
    recorded = recorded_trace(4)
    pred = TiledPredictor(NoisyOraclePredictor(recorded, 1, 1.0), 4)
    assert [pred.covers(l) for l in range(8)] == [True, True, True, False] * 2
    from predictors.base import LayerContext

    ctx = LayerContext(layer=3, step=0, experts=recorded.experts[3, :2], weights=recorded.weights[3, :2], rows=np.arange(2))
    with pytest.raises(ValueError, match="crosses the end"):
        pred.predict(ctx)


def test_the_recording_cache_key_follows_every_input() -> None:
    import copy

    from engine.serverless.model_routing import cache_key
    from engine.workloads.config import AzureWorkloadConfig, WorkloadConfig, WorkloadKind

    ckpt = "pkg:models/checkpoints/mixtral-tiny"
    wl = WorkloadConfig(name="azure_conv", kind=WorkloadKind.azure, azure=AzureWorkloadConfig(peak=True, duration_s=30.0))
    key = cache_key(ckpt, wl, None, 0)
    assert key == cache_key(ckpt, copy.deepcopy(wl), None, 0)  # stable
    capped = copy.deepcopy(wl)
    capped.azure.max_context_tokens = 100
    changed = [cache_key(ckpt, capped, None, 0), cache_key(ckpt, wl, 3, 0), cache_key(ckpt, wl, None, 1),
               cache_key("pkg:models/checkpoints/deepseek-tiny", wl, None, 0)]
    assert len({key, *changed}) == 5


@pytest.mark.slow  # records a 2-s replay with mixtral-tiny (about a minute on 2 cores)
def test_moeless_predictor_drives_moeless_on_recorded_routing_and_the_recording_is_cached(tmp_path, monkeypatch) -> None:
    from conf import compose
    from engine.serve import run
    from engine.serverless import model_routing
    from omegaconf import OmegaConf

    overrides = ["routing_checkpoint=pkg:models/checkpoints/mixtral-tiny", "predictor=moeless_mixtral_tiny",
                 "workload.azure.duration_s=2", "workload.azure.max_context_tokens=48", "decode_stride=4",
                 "systems=[static_ep,moeless]", "experiments=[compare,distance]", "serverless.sweeps.distances=[1,2]",
                 "wandb.mode=disabled", "plots=false"]
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOESCOPE_ROUTING_CACHE", str(cache))
    first = run(compose("serve", overrides), run_dir=tmp_path / "a")
    second = run(compose("serve", overrides), run_dir=tmp_path / "b")
    assert not first["routing_detail"]["cache"]["cached"] and second["routing_detail"]["cache"]["cached"]
    # the cached recording replays the same routing (and so the same forecasts); timings may differ
    a, b = (RoutingTrace.load(tmp_path / x / "routing_trace.npz") for x in "ab")
    assert np.array_equal(a.experts, b.experts) and np.array_equal(a.weights, b.weights) and a.num_rows > 0
    assert first["predictor"] == second["predictor"] and first["routing_statistics"] == second["routing_statistics"]
    caps = first["routing_detail"]["context_caps"]
    assert (caps["model_positions"], caps["max_context_tokens"], caps["max_generated_tokens"]) == (1024, 48, 256)
    p = first["predictor"]
    assert p["kind"] == "moeless" and "upper_bound" not in p
    # 32 simulated layers cycle through 8 recorded ones: d = 1 forecasts 28 of them from the predictor
    assert p["layers_forecast_by_predictor"] == {"1": 28 / 32, "2": 24 / 32}
    # trained gate copies on the recorded gate inputs: well above the frequency baseline, not an oracle
    assert 0.7 < p["hit_rate_by_distance"]["2"] < p["hit_rate_by_distance"]["1"] < 0.99
    recorded = RoutingTrace.load(tmp_path / "a" / "routing_trace.npz")
    assert recorded.num_layers == 8 and recorded.pos.max() < 1024
    wl = OmegaConf.to_object(compose("serve", overrides).workload)
    wl.azure.max_context_tokens, wl.azure.max_generated_tokens = 48, 256
    assert (cache / model_routing.cache_key("pkg:models/checkpoints/mixtral-tiny", wl, None, 0) / "trace.npz").is_file()
