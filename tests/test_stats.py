"""Routing statistics: hand-computed cases, scipy / HitStats references, synthetic traces with known
structure, and the `engine.stats` entry point (results.json, figures, offline wandb, clear errors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.spatial.distance import cosine
from scipy.stats import variation

from core.config import REPO_ROOT
from conf import compose
from core.routing_stats import (TransitionTable, coefficient_of_variation, gate_input_similarity, hit_rate,
                                  hot_experts, load_accuracy, load_stats, routing_report, split_by_sequence,
                                  step_loads)
from engine.stats import stats_trace
from core.trace import PREFILL, RoutingTrace, TraceMeta, TraceRecorder
from predictors.base import HitStats

DATA = Path(__file__).parent / "data" / "vllm_routing"


def _trace(experts: np.ndarray, seq: np.ndarray, num_experts: int, hidden: np.ndarray | None = None,
           step: np.ndarray | None = None) -> RoutingTrace:
    """A trace from experts [L, N, k] with one step per sequence unless `step` is given."""
    L, N, k = experts.shape
    step = seq if step is None else step
    pos = np.zeros(N, np.int32)
    for s in np.unique(seq):
        pos[seq == s] = np.arange(int((seq == s).sum()))
    meta = TraceMeta(model="synthetic", num_experts=num_experts, top_k=k, moe_layers=tuple(range(L)),
                     hidden_size=0 if hidden is None else hidden.shape[2])
    return RoutingTrace(meta=meta, experts=experts, weights=np.full((L, N, k), 1.0 / k, np.float32), step=step,
                        batch=seq, seq=seq, pos=pos, token=np.full(N, -1), phase=np.zeros(N, np.int8),
                        hidden=hidden)


# ---- hand-computed cases ------------------------------------------------------------------------------
def test_cv_matches_scipy_and_hand_value() -> None:
    assert coefficient_of_variation(np.array([3, 1, 0, 0]))[()] == pytest.approx(np.sqrt(1.5))  # mean 1, var 1.5
    loads = np.random.default_rng(0).integers(0, 50, size=(6, 16))
    np.testing.assert_allclose(coefficient_of_variation(loads), variation(loads, axis=1))
    assert coefficient_of_variation(np.zeros(4))[()] == 0.0


def test_hot_experts_threshold() -> None:
    share = np.array([0.1, 0.5, 0.3, 0.1])
    assert hot_experts(share, 1.5) == [1]  # >= 0.375
    assert hot_experts(share, 1.0) == [1, 2]  # >= 0.25, hottest first


def test_transition_table_hand_case() -> None:
    # train pairs (layer l -> l+1), top-1: 0->1 x3, 0->2, 1->3 x2, 2->0
    src = np.array([[0], [0], [0], [0], [1], [1], [2]])
    dst = np.array([[1], [1], [1], [2], [3], [3], [0]])
    table = TransitionTable(4).fit(src, dst)
    np.testing.assert_allclose(table.conditional()[0], [0, 0.75, 0.25, 0])
    # expert 3 never seen as a source: falls back to the most frequent target (1)
    pred = table.predict(np.array([[0], [1], [2], [3]]), k=1)
    assert pred[:, 0].tolist() == [1, 3, 0, 1]
    actual = np.array([[1], [3], [2], [1]])
    assert hit_rate(pred, actual, 4) == 0.75
    assert hit_rate(table.frequency_predict(4, 1), actual, 4) == 0.5


def test_transition_scores_sum_conditionals_for_top2() -> None:
    src = np.array([[0, 1], [0, 2]])
    dst = np.array([[2, 3], [3, 1]])
    table = TransitionTable(4).fit(src, dst)
    # P(.|0) = {2: .25, 3: .5, 1: .25}, P(.|1) = {2: .5, 3: .5}; token with (0, 1): 3 -> 1.0, 2 -> .75
    assert table.predict(np.array([[0, 1]]), k=2).tolist() == [[3, 2]]


def test_hit_rate_agrees_with_hitstats_on_random_routing() -> None:
    rng = np.random.default_rng(1)
    pred = np.stack([rng.permutation(16)[:4] for _ in range(300)])
    actual = np.stack([rng.permutation(16)[:4] for _ in range(300)])
    stats = HitStats()
    stats.record(3, pred, actual)
    assert hit_rate(pred, actual, 16) == pytest.approx(stats.hit_rate(3))


def test_load_accuracy_hand_case() -> None:
    # step 0: true loads e0:2 e1:2, predicted e0:3 e2:1 -> overlap 2 of 4; step 1: exact -> 1
    pred = np.array([[0], [0], [0], [2], [3], [1]])
    actual = np.array([[0], [0], [1], [1], [3], [1]])
    groups = np.array([0, 0, 0, 0, 1, 1])
    assert load_accuracy(pred, actual, groups, 4) == pytest.approx((2 / 4 + 1.0) / 2)


def test_gate_similarity_matches_scipy_cosine() -> None:
    rng = np.random.default_rng(2)
    hidden = rng.normal(size=(3, 10, 8)).astype(np.float16)
    trace = _trace(rng.integers(0, 4, size=(3, 10, 1)), np.repeat([0, 1], 5).astype(np.int32), 4, hidden=hidden)
    ref = np.mean([1 - cosine(hidden[0, n].astype(np.float64), hidden[2, n].astype(np.float64)) for n in range(10)])
    assert gate_input_similarity(trace, 2)[0] == pytest.approx(ref, abs=1e-5)


def test_step_loads_and_per_step_cv() -> None:
    experts = np.array([[[0], [0], [1], [2]]])  # one layer, steps [0, 0] and [1, 2]
    trace = _trace(experts, np.array([0, 0, 1, 1], np.int32), 4)
    assert step_loads(trace)[:, 0].tolist() == [[2, 0, 0, 0], [0, 1, 1, 0]]
    stats = load_stats(trace)
    assert stats.step_cv_mean[0] == pytest.approx((np.sqrt(3) + 1) / 2)  # CV [2,0,0,0] = sqrt 3, [0,1,1,0] = 1


def test_split_by_sequence_is_disjoint_and_seeded() -> None:
    trace = _trace(np.zeros((2, 40, 1), np.int64), np.repeat(np.arange(8), 5).astype(np.int32), 4)
    train, test = split_by_sequence(trace, 0.25, seed=3)
    assert not set(trace.seq[train]) & set(trace.seq[test]) and len(set(trace.seq[test])) == 2
    assert np.array_equal(test, split_by_sequence(trace, 0.25, seed=3)[1])
    with pytest.raises(ValueError, match=">= 2 sequences"):
        split_by_sequence(_trace(np.zeros((2, 5, 1), np.int64), np.zeros(5, np.int32), 4), 0.25)


# ---- synthetic traces with known structure -----------------------------------------------------------
def _markov_trace(rng: np.random.Generator, follow: float, skew: float, L: int = 6, E: int = 8, n_seq: int = 40,
                  tokens: int = 30, hidden_size: int = 16) -> RoutingTrace:
    """Top-1 routing: layer 0 draws from a Zipf-like law of exponent `skew`; layer l+1 takes
    perm[l](expert at l) with probability `follow`, else a uniform expert. Hidden states drift slowly."""
    rec = TraceRecorder(TraceMeta("markov", E, 1, tuple(range(L)), hidden_size), keep_hidden=True)
    p0 = 1.0 / np.arange(1, E + 1) ** skew
    p0 /= p0.sum()
    perms = [rng.permutation(E) for _ in range(L)]
    for s in range(n_seq):
        e = rng.choice(E, size=tokens, p=p0)
        h = rng.normal(size=(tokens, hidden_size))
        experts, hidden = [], []
        for layer in range(L):
            experts.append(e[:, None])
            hidden.append(h.copy())
            keep = rng.random(tokens) < follow
            e = np.where(keep, perms[layer][e], rng.integers(0, E, tokens))
            h = h + 0.3 * rng.normal(size=h.shape)
        rec.add_step(experts, [np.ones((tokens, 1))] * L, seq=np.full(tokens, s), pos=np.arange(tokens),
                     phase=PREFILL, hidden=hidden)
    return rec.build()


def test_structured_routing_is_skewed_and_predictable() -> None:
    report = routing_report(_markov_trace(np.random.default_rng(0), follow=0.9, skew=1.5), distances=(1, 2))
    s = report["summary"]
    assert s["cv_min"] > 0.5 and s["hot_experts_per_layer"] >= 1
    # P(hit) = 0.9 + 0.1 / 8 at d = 1 and (0.9^2 + ...) at d = 2; the frequency baseline is far below
    assert s["hit_transition_d1_mean"] == pytest.approx(0.9 + 0.1 / 8, abs=0.04)
    assert s["hit_transition_d2_mean"] == pytest.approx(0.81 + 0.19 / 8, abs=0.05)
    assert s["hit_frequency_d1_mean"] < s["hit_transition_d1_mean"] - 0.3
    assert s["load_acc_transition_d1_mean"] > s["load_acc_frequency_d1_mean"]
    # cos of h and h + 0.3 d noise: 1 / sqrt(1 + 0.09 d)
    assert s["similarity_d1_mean"] == pytest.approx(1 / np.sqrt(1.09), abs=0.02)
    assert s["similarity_d2_mean"] < s["similarity_d1_mean"]


def test_uniform_random_routing_is_balanced_and_unpredictable() -> None:
    report = routing_report(_markov_trace(np.random.default_rng(1), follow=0.0, skew=0.0), distances=(1,))
    s = report["summary"]
    assert s["cv_max"] < 0.2 and s["hot_experts_per_layer"] == 0
    assert s["hit_transition_d1_mean"] == pytest.approx(1 / 8, abs=0.05)


def test_report_on_vllm_fixture_without_hidden_notes_what_is_skipped() -> None:
    from core.trace_import import import_vllm_jsonl

    report = routing_report(import_vllm_jsonl(DATA / "forward_passes.jsonl"), distances=(1, 5))
    assert report["trace"]["distances"] == [1]  # 5 is beyond the 4 MoE layers
    assert all(not r["similarity"] for r in report["layers"]) and "hidden states" in report["notes"][0]
    assert set(report["layers"][0]["hit_rate"]) == {"1"} and report["layers"][-1]["hit_rate"] == {}
    with pytest.raises(ValueError, match="distances"):
        routing_report(import_vllm_jsonl(DATA / "forward_passes.jsonl"), distances=(0,))


# ---- entry point ---------------------------------------------------------------------------------------
def test_trace_source_without_a_file_names_the_key() -> None:
    from omegaconf import OmegaConf

    cfg = compose("stats", ["source=trace"])
    with pytest.raises(ValueError, match="source=trace needs trace="):
        stats_trace(OmegaConf.to_object(cfg))
    cfg = compose("stats", ["source=trace", "trace=routing.csv"])
    with pytest.raises(ValueError, match="trace_format"):
        stats_trace(OmegaConf.to_object(cfg))


@pytest.mark.slow
def test_model_source_records_a_checkpoint_serving_a_workload(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from engine.stats import run_stats
    from core.telemetry import Telemetry
    from engine.workloads import load_sharegpt
    from models.hf import save_hf
    from models.loading import resolve_model_config
    from models.tokenizer import save_hf_tokenizer, train_bpe
    from models.transformer import build_model

    arch = resolve_model_config(compose("stats").model)
    folder = save_hf(arch, build_model(arch, seed=0), tmp_path / "ckpt")
    save_hf_tokenizer(train_bpe([p.text for p in load_sharegpt()], vocab_size=arch.vocab_size), folder)
    cfg = compose("stats", [f"model.checkpoint={folder}", "workload=sharegpt", "workload.num_batches=2",
                            "workload.batch_size=3", "workload.prompt_len=12", "workload.gen_len=4",
                            "workload.min_prompt_tokens=4", "distances=[1]", "plots=false", "wandb.mode=disabled"])
    with Telemetry(cfg, task="stats", run_dir=tmp_path / "run") as tm:
        report = run_stats(OmegaConf.to_object(cfg), tm)
    facts = report["trace"]
    assert facts["sequences"] == 6 and facts["has_hidden"] and facts["moe_layers"] == list(range(arch.num_hidden_layers))
    assert RoutingTrace.load(tmp_path / "run" / "trace.npz").num_rows == facts["rows"]
    assert "similarity_d1_mean" in report["summary"] and "hit_transition_d1_mean" in report["summary"]


def test_entry_point_writes_results_figures_and_offline_wandb(tmp_path: Path) -> None:
    trace_path = _markov_trace(np.random.default_rng(3), follow=0.8, skew=1.2, n_seq=8).save(tmp_path / "t.npz")
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_SILENT": "true", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "engine.stats", "source=trace", f"trace={trace_path}",
                           "distances=[1,2]", "wandb.mode=offline", f"hydra.run.dir={run_dir}"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["trace"]["rows"] == 8 * 30 and len(results["layers"]) == 6
    assert results["summary"]["hit_transition_d1_mean"] > results["summary"]["hit_frequency_d1_mean"]
    for name in ("expert_load.png", "load_cv.png", "gate_similarity.png", "predictability.png"):
        assert (run_dir / name).stat().st_size > 1000 and name in results["plots"]
    assert list((run_dir / "wandb").glob("offline-run-*"))
    assert "routing statistics: markov" in proc.stdout and "hit_transition_d1_mean" in proc.stdout


def test_entry_point_bad_trace_file_fails_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "log.jsonl"
    bad.write_text('{"problem_id": 0, "layer": 0, "experts": [1], "gating_probs": [1.0], "token_idx": 0}\n{oops\n')
    proc = subprocess.run([sys.executable, "-m", "engine.stats", "source=trace", f"trace={bad}", "wandb.mode=disabled",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "log.jsonl:2: invalid JSON" in proc.stderr
