"""Real predictors and real routing logs in the simulator (issue 20, items 2 and 4): routing-only predictors
(stats, the transition table) fitted on routing held out of the replay, the oracle labelled as the upper bound it
is, decode-only and incomplete vLLM logs replayed as they are, batches no log can fill refused, routing-only
training on a JSONL log, checkpoint distances PreSched cannot use named, HF `output_router_logits` routing."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from conf import compose
from core.telemetry import Telemetry
from core.trace import DECODE, PREFILL, RoutingTrace, TraceMeta
from core.trace_import import LogPhase, import_hf_router_logits, import_vllm_jsonl, save_hf_router_logits
from engine.sim.routing import RoutingConfig
from engine.sim.run import RunSpec, prepare_routing, simulate
from engine.sim.timeline import plot_timeline
from engine.simulate import predictor_results
from models.loading import resolve_model_config
from predictors.base import LayerContext
from predictors.checkpoint import save_predictor
from predictors.config import PredictorConfig, PredictorKind, oracle_config
from predictors.factory import make_predictors
from predictors.oracle import count_hits
from predictors.stats import StatsPredictor
from predictors.transition import TransitionPredictor
from schedulers.hardware import load_hardware
from schedulers.offload.presched import PreSchedSettings

E, K = 8, 2


@functools.lru_cache(maxsize=None)
def mixtral(layers: int):
    cfg = resolve_model_config(compose("simulate", ["model=mixtral_8x7b"]).model)
    return cfg.replace(num_hidden_layers=layers)


def spec(layers: int = 3, **kw) -> RunSpec:
    base = dict(model=mixtral(layers), model_name=f"mixtral-{layers}l", hardware=load_hardware("v100_pcie3"),
                scheduler=PreSchedSettings(), batch_size=4, prompt_len=8, gen_len=4, check_invariants=True,
                cache_slots=6, profile_sequences=16)
    return RunSpec(**{**base, **kw})


def predictor(kind: str) -> PredictorConfig:
    return PredictorConfig(name=kind, kind=PredictorKind(kind))


def chained_trace(num_seqs: int, tokens: int = 5, layers: int = 3, seed: int = 0) -> RoutingTrace:
    """Layer l + 1's experts are a fixed permutation of layer l's (3e + 1 mod 8): a transition table learns it
    exactly, a frequency table cannot."""
    rng = np.random.default_rng(seed)
    n = num_seqs * tokens
    first = np.stack([rng.choice(E, K, replace=False) for _ in range(n)])
    experts = [first]
    for _ in range(layers - 1):
        experts.append((3 * experts[-1] + 1) % E)
    seq = np.repeat(np.arange(num_seqs), tokens).astype(np.int32)
    meta = TraceMeta(model="chained", num_experts=E, top_k=K, moe_layers=tuple(range(layers)))
    return RoutingTrace(meta=meta, experts=np.stack(experts).astype(np.int16), weights=np.full((layers, n, K), 0.5,
                        np.float32), step=seq, batch=np.zeros(n, np.int32), seq=seq,
                        pos=np.tile(np.arange(tokens), num_seqs).astype(np.int32), token=np.full(n, -1, np.int32),
                        phase=np.full(n, PREFILL, np.int8))


def hit_rate(pred, trace: RoutingTrace, rows: np.ndarray, distance: int = 1) -> float:
    ctx = LayerContext(layer=0, step=0, experts=trace.experts[0, rows], weights=trace.weights[0, rows])
    actual = trace.experts[distance, rows]
    return count_hits(pred.predict_topk(ctx), actual) / actual.size


def write_log(path: Path, seqs: int, tokens: int, layers: int, phase: str | None = None, skip: tuple = ()) -> Path:
    """A vLLM-style log with absolute token positions (each (sequence, token, layer) once)."""
    rng = np.random.default_rng(3)
    lines = []
    for s in range(seqs):
        for t in range(tokens):
            for layer in range(layers):
                if (s, t, layer) in skip:
                    continue
                rec = {"problem_id": s, "token_idx": t, "layer": layer,
                       "experts": [int(x) for x in rng.choice(E, K, replace=False)], "gating_probs": [0.6, 0.4]}
                if phase:
                    rec["phase"] = phase
                lines.append(json.dumps(rec))
    path.write_text("\n".join(lines))
    return path


# ---- the transition-table predictor --------------------------------------------------------------------------
def test_transition_table_learns_layer_to_layer_routing_that_frequencies_miss() -> None:
    trace = chained_trace(40)
    train = trace.seq < 20
    test = np.flatnonzero(~train)
    table = TransitionPredictor.fit(trace, train, distance=1)
    assert hit_rate(table, trace, test) == 1.0
    assert hit_rate(StatsPredictor.fit(trace, train), trace, test) < 0.6
    two = TransitionPredictor.fit(trace, train, distance=2)  # l -> l + 2 composes the permutation
    assert hit_rate(two, trace, test, distance=2) == 1.0


def test_transition_checkpoint_round_trips_and_a_distance_presched_cannot_read_is_named(tmp_path: Path) -> None:
    trace = chained_trace(12)
    folder = save_predictor(TransitionPredictor.fit(trace, trace.seq < 6, "transition", 2), tmp_path / "t2")
    cfg = PredictorConfig(name="transition", kind=PredictorKind.transition, distance=2, checkpoint=str(folder))
    loaded = make_predictors(cfg, [1, 2, 3], trace=trace)  # serves its own distance only
    assert sorted(loaded) == [2] and hit_rate(loaded[2], trace, np.flatnonzero(trace.seq >= 6), distance=2) == 1.0
    with pytest.raises(ValueError, match=r"predicts distance 2.*distances \[1\].*scheduler.max_window"):
        make_predictors(cfg, [1], trace=trace)


# ---- real predictors in the simulator ------------------------------------------------------------------------
def test_simulator_runs_routing_only_predictors_fitted_on_held_out_routing() -> None:
    for kind, cls in (("stats", StatsPredictor), ("transition", TransitionPredictor)):
        s = spec(predictor=predictor(kind))
        prepared = prepare_routing(s)
        out = simulate(s, prepared)
        preds = out.sim.forecasts.predictors
        assert sorted(preds) == [1, 2] and all(isinstance(p, cls) for p in preds.values())
        if kind == "stats":  # counted on the profiling traffic, not on the routing being replayed
            assert np.array_equal(preds[1].counts, prepared.train.expert_loads())
            assert not np.array_equal(preds[1].counts, prepared.trace.expert_loads())
        hit = out.summary["predictor_hit_rate"]
        assert 0.0 < hit < 0.9  # measured on the replay, not an assumed figure
        res = predictor_results(s, out)
        assert res["predictor_kind"] == kind and "predictor_hit_rate_target" not in res
    oracle = spec(predictor=oracle_config(hit_rate=0.95))
    res = predictor_results(oracle, simulate(oracle))
    assert res["predictor_kind"] == "oracle (upper bound)" and res["predictor_hit_rate_target"] == 0.95


def test_predictors_whose_inputs_the_replay_lacks_fail_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"predictor=llapor.*gate inputs \(hidden states\).*routing=synthetic"):
        simulate(spec(predictor=predictor("llapor")))
    log = write_log(tmp_path / "four.jsonl", seqs=4, tokens=3, layers=3)  # one batch: nothing held out to fit on
    with pytest.raises(ValueError, match=r"predictor=stats.*held out of the replay.*four.jsonl gives no batch"):
        simulate(spec(predictor=predictor("stats"), routing=RoutingConfig(source="jsonl", name="l", path=str(log))))


# ---- real routing logs -----------------------------------------------------------------------------------------
def test_decode_only_log_replays_as_decode_steps_and_draws_a_timeline(tmp_path: Path) -> None:
    log = write_log(tmp_path / "decode.jsonl", seqs=8, tokens=5, layers=3, skip=((7, 4, 2),))
    routing = RoutingConfig(source="jsonl", name="log", path=str(log), phase=LogPhase.decode)
    with pytest.raises(ValueError, match=r"decode.jsonl:\d+: sequence '7' token 4.*routing.drop_incomplete=true"):
        prepare_routing(spec(routing=routing, profile_batches=1))
    s = spec(routing=RoutingConfig(source="jsonl", name="log", path=str(log), phase=LogPhase.decode,
                                   drop_incomplete=True), profile_batches=1, predictor=predictor("transition"))
    prepared = prepare_routing(s)
    assert prepared.passes and all(not fp.prefill for fp in prepared.passes)
    assert [fp.num_seqs for fp in prepared.passes] == [4] * 4 + [3]  # batch 1: sequences 4..7, 7 loses token 4
    out = simulate(s, prepared, record=True, record_passes={1})
    assert out.summary["prefill_s"] == 0 and out.summary["decode_latency_s"] > 0
    assert out.summary["tokens_generated"] == 19
    assert plot_timeline(out.sim.events, 1, 3) is not None
    # the same log saying `"phase": "decode"` on its lines needs no option
    marked = import_vllm_jsonl(write_log(tmp_path / "marked.jsonl", 8, 5, 3, phase="decode"), num_experts=E)
    assert (marked.phase == DECODE).all() and marked.num_steps == 8 * 5
    assert (import_vllm_jsonl(log, num_experts=E, drop_incomplete=True).phase == PREFILL).sum() == 39  # auto


def test_a_batch_no_log_can_fill_fails_naming_batch_size(tmp_path: Path) -> None:
    log = write_log(tmp_path / "six.jsonl", seqs=6, tokens=3, layers=3)
    routing = RoutingConfig(source="jsonl", name="log", path=str(log))
    with pytest.raises(ValueError, match=r"batch_size=8: routing.path=.*six.jsonl holds 6 sequences, and a batch"):
        prepare_routing(spec(routing=routing, batch_size=8))
    with pytest.raises(ValueError, match=r"batch_size=4: .*holds 6 sequences, so replayed batch 1 would have fewer"):
        prepare_routing(spec(routing=routing, batch_size=4, profile_batches=0, num_batches=2))


def test_predictors_train_fits_routing_only_methods_on_a_jsonl_log(tmp_path: Path) -> None:
    from predictors.train import run

    log = write_log(tmp_path / "log.jsonl", seqs=12, tokens=6, layers=4)  # tiny_mixtral: 4 MoE layers, 8 experts
    node = compose("predictors_train", ["model=tiny_mixtral", f"trace={log}", "shift=false", "predictor=transition",
                                        "plots=false", "checkpoint_every=0", "wandb.mode=disabled"])
    with Telemetry(node, task="predictors_train", run_dir=tmp_path / "run") as tm:
        res = run(OmegaConf.to_object(node), tm)
    assert {"transition", "stats", "oracle"} <= set(res["methods"])
    assert set(res["skipped"]) == {"gate", "token", "moeless"} and "hidden states" in res["skipped"]["gate"]
    assert (tmp_path / "run" / "predictors" / "transition" / "predictor.json").is_file()
    node = compose("predictors_train", ["model=tiny_mixtral", f"trace={log}", "shift=false", "wandb.mode=disabled"])
    with Telemetry(node, task="predictors_train", run_dir=tmp_path / "run2") as tm:
        with pytest.raises(ValueError, match=r"predictor=llapor: trace=.*log.jsonl has no gate inputs"):
            run(OmegaConf.to_object(node), tm)


# ---- HF output_router_logits -----------------------------------------------------------------------------------
def test_hf_router_logits_import_top_k_of_the_softmax_without_padding(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2 * 5, 4)).astype(np.float32)
    mask = np.ones((2, 5), np.int8)
    mask[1, :2] = 0  # left padding
    path = save_hf_router_logits(tmp_path / "r.npz", [logits, logits[::-1].copy()], batch=2, seq_len=5,
                                 attention_mask=mask, model="m")
    trace = import_hf_router_logits(path, top_k=2)
    assert trace.num_rows == 8 and trace.num_layers == 2 and trace.meta.num_experts == 4
    assert trace.pos[trace.seq == 1].tolist() == [0, 1, 2]
    real = logits.reshape(2, 5, 4)[mask.astype(bool)]
    assert np.array_equal(trace.experts[0], np.argsort(-real, axis=1, kind="stable")[:, :2])
    assert np.allclose(trace.weights.sum(axis=2), 1.0)


@pytest.mark.slow
def test_hf_mixtral_run_with_output_router_logits_imports_and_replays(tmp_path: Path) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_tiny import hf_model

    model = hf_model("mixtral")  # 3 layers, 4 experts, top-2
    ids = torch.randint(3, 90, (4, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    path = save_hf_router_logits(tmp_path / "hf.npz", out.router_logits, batch=4, seq_len=7, model="tiny-mixtral")
    trace = import_hf_router_logits(path, top_k=2)
    top = torch.topk(torch.softmax(out.router_logits[1].float(), dim=-1), 2).indices.numpy()
    assert np.array_equal(np.sort(trace.experts[1], axis=1), np.sort(top, axis=1))
    cfg = mixtral(3).replace(num_experts=4)
    s = spec(3, model=cfg, routing=RoutingConfig(source="hf", name="hf", path=str(path)), batch_size=2,
             profile_batches=1, cache_slots=4, predictor=predictor("transition"))
    result = simulate(s)
    assert result.summary["tokens_generated"] == 2 and result.summary["prefill_s"] > 0
