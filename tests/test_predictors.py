"""Expert predictors on hand-checkable cases: metrics, stats, gate (against the model's own routers),
LLaPor's loss and training, online fine-tuning trigger, MoEless's selective fine-tuning, layer
groups, splits, and orbax save / restore through `load_predictor`."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from scipy.stats import pearsonr

from conf import compose
from predictors.config import (GroupMode, LayerGroup, MoElessSpec, OnlineSpec, PredictorConfig,
                                    PredictorKind)
from predictors import load_predictor
from predictors.base import LayerContext, Predictor, topk_experts
from predictors.checkpoint import PredictorCheckpointError, save_predictor
from predictors.config import predictor_config
from predictors.data import layer_pairs, pairs_context, split_rows, trace_context
from predictors.evaluate import evaluate_offline, evaluate_online
from predictors.groups import GroupsSpec, groups_from_spec, split_by_score
from predictors.metrics import (hot_topn_accuracy, layer_metrics, load_pearson, per_step_loads, per_step_pearson,
                                token_coverage)
from predictors.nets import hybrid_loss
from predictors.online import OnlineMonitor, token_errors
from predictors.stats import StatsPredictor
from predictors.synthetic import shift_rule_trace


def _cfg(kind: str, **overrides) -> PredictorConfig:
    """The shipped conf/predictor/<kind>.yaml with dotted overrides."""
    node = compose("predictors_train", [f"predictor={kind}"] + [f"predictor.{k}={v}" for k, v in overrides.items()])
    return predictor_config(node.predictor)


# ---- metrics ---------------------------------------------------------------------------------------------------
def test_hot_top4_within_true_top6_and_token_coverage_hand_case() -> None:
    true = np.array([[9, 7, 5, 4, 3, 2, 1, 0]])  # true top-6: experts 0..5; top-4 tokens 9+7+5+4 = 25
    pred = np.array([[8, 0, 0, 0, 0, 7, 6, 5]])  # forecast hot 4: experts 0, 5, 6, 7
    # within true top-6: experts 0 and 5 -> 2 of 4
    assert hot_topn_accuracy(pred, true, n=4, slack=2) == pytest.approx(0.5)
    # covered true tokens: 9 (e0) + 2 (e5) + 1 (e6) + 0 (e7) = 12 of 25
    assert token_coverage(pred, true, n=4) == pytest.approx(12 / 25)
    assert hot_topn_accuracy(true, true) == 1.0 and token_coverage(true, true) == 1.0


def test_hot_accuracy_normalises_by_active_experts_and_counts_ties_at_the_cutoff() -> None:
    true = np.array([[3, 0, 0, 1, 0, 0, 0, 0],   # two active experts: min(4, 2) = 2 can be right
                     [2, 2, 2, 2, 2, 2, 2, 1]])  # ties: every expert with 2 tokens is within the top-6
    pred = np.array([[5, 4, 0, 3, 0, 0, 0, 0],   # hot 4 = {0, 1, 3, 2}: e0, e3 active -> 2 / 2
                     [0, 0, 0, 0, 0, 0, 9, 8]])  # hot 4 = {6, 7, 0, 1}: e6, e0, e1 have 2 tokens, e7 has 1 -> 3 / 4
    assert hot_topn_accuracy(pred, true) == pytest.approx((1.0 + 0.75) / 2)


def test_load_pearson_matches_scipy_and_per_step_loads_count_tokens() -> None:
    rng = np.random.default_rng(0)
    pred, true = (np.stack([rng.choice(8, 2, replace=False) for _ in range(50)]) for _ in range(2))
    step = np.repeat(np.arange(5), 10)
    p, t = per_step_loads(pred, step, 8), per_step_loads(true, step, 8)
    assert p.shape == (5, 8) and p.sum() == 100 and p[2].sum() == 20
    assert p[0, 3] == int((pred[:10] == 3).sum())
    assert load_pearson(p, t) == pytest.approx(pearsonr(p.ravel(), t.ravel())[0])
    np.testing.assert_allclose(per_step_pearson(p, t), [pearsonr(p[i], t[i])[0] for i in range(5)], atol=1e-12)
    assert np.isnan(per_step_pearson(np.ones((1, 8)), t[:1])[0])  # a constant forecast has no correlation
    perfect = layer_metrics(true, true, step, 8)
    assert all(perfect[m] == pytest.approx(1.0) for m in ("hit", "hot", "coverage", "pearson", "pearson_step", "load_acc"))


# ---- data ------------------------------------------------------------------------------------------------------
def test_split_is_by_sequence_and_pairs_align_layers() -> None:
    trace = shift_rule_trace(np.random.default_rng(1), n_seq=20)
    split = split_rows(trace, 0.25, 0.2, seed=3)
    sets = [set(trace.seq[m].tolist()) for m in (split.train, split.val, split.test)]
    assert all(sets) and not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert (split.train | split.val | split.test).all() and len(sets[2]) == 5
    pairs = layer_pairs(trace, 1, 2, split.test)
    np.testing.assert_array_equal(pairs.target, trace.experts[3][split.test])
    np.testing.assert_array_equal(pairs.hidden, trace.hidden[1][split.test].astype(np.float32))


# ---- stats -----------------------------------------------------------------------------------------------------
def test_stats_ranking_is_the_frequency_table_of_its_training_rows() -> None:
    trace = shift_rule_trace(np.random.default_rng(2))
    train = trace.seq < 16
    pred = StatsPredictor.fit(trace, train)
    for target in pred.targets:
        freq = np.bincount(trace.experts[target][train].ravel(), minlength=8)
        ctx = trace_context(trace, target - 1, np.arange(5))
        scores = pred.predict(ctx)
        np.testing.assert_allclose(scores[0], freq / freq.sum(), rtol=1e-6)
        np.testing.assert_array_equal(topk_experts(scores, 2)[0], np.argsort(-freq, kind="stable")[:2])
    before = pred.counts.copy()
    pred.observe(2, trace_context(trace, 1, np.arange(3)), np.array([[0, 1]] * 3))
    np.testing.assert_array_equal(pred.counts, before)  # online counting is off by default
    pred.online = True
    pred.observe(2, trace_context(trace, 1, np.arange(3)), np.array([[0, 1]] * 3))
    assert pred.counts[2, 0] == before[2, 0] + 3 and pred.counts[2, 1] == before[2, 1] + 3


# ---- gate ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_name", ["tiny_mixtral", "tiny_mixtral:sigmoid", "tiny_deepseek_v2", "tiny_moonlight"])
def test_gate_equals_the_family_routing_when_gate_inputs_are_equal(model_name: str) -> None:
    """Also for the numpy scoring of plain top-k families, which must equal the jitted scores."""
    from flax import nnx

    from models.loading import resolve_model_config
    from models.moe import Router
    from predictors.gate import GatePredictor, compiled_gate_scores, host_routable

    import dataclasses

    from models.config import ScoringFunc

    name, _, scoring = model_name.partition(":")
    cfg = resolve_model_config(compose("record", [f"model={name}"]).model)
    if scoring:  # a sigmoid-scored plain top-k router (no shipped family has one)
        cfg = dataclasses.replace(cfg, scoring_func=ScoringFunc(scoring))
    assert host_routable(cfg) == (name != "tiny_moonlight")  # grouped top-k with a bias stays jitted
    L = len(cfg.moe_layers)
    routers = [Router(cfg, rngs=nnx.Rngs(params=i)) for i in range(L)]
    for r in routers:
        if r.bias is not None:  # DeepSeek-V3: a score-correction bias that changes the choice, not the weights
            r.bias[...] = np.random.default_rng(0).normal(0, 0.05, r.bias.shape)
    gate = GatePredictor("gate", 1, cfg, {j: np.asarray(routers[j].weight[...]).T for j in range(1, L)},
                         {j: np.asarray(routers[j].bias[...]) if routers[j].bias is not None else np.zeros(cfg.num_experts)
                          for j in range(1, L)})
    assert isinstance(gate, Predictor) and gate.targets == list(range(1, L))
    h = np.random.default_rng(4).standard_normal((40, cfg.hidden_size)).astype(np.float32)
    for target in gate.targets:
        truth = np.asarray(routers[target](h).experts)  # layer `target`'s router seeing the same gate input
        ctx = LayerContext(layer=target - 1, step=0, experts=np.zeros((40, 1), np.int64),
                           weights=np.ones((40, 1), np.float32), hidden=h)
        np.testing.assert_array_equal(np.sort(gate.predict_topk(ctx), axis=1), np.sort(truth, axis=1))
        jitted = np.asarray(compiled_gate_scores(cfg)(h, gate.kernels[target], gate.biases[target]))
        np.testing.assert_allclose(gate.scores(target, ctx), jitted, atol=1e-5)
        gate.observe(target, ctx, truth)
        assert gate.hit_rate(target) == 1.0
    with pytest.raises(ValueError, match="LayerContext.hidden"):
        gate.predict(LayerContext(layer=0, step=0, experts=np.zeros((2, 1)), weights=np.ones((2, 1))))


def test_gate_without_hidden_or_model_fails_clearly() -> None:
    with pytest.raises(ValueError, match="pass the model"):
        load_predictor({"name": "gate", "kind": "gate"})
    with pytest.raises(ValueError, match="predictor.checkpoint"):
        load_predictor({"name": "llapor", "kind": "llapor"})
    with pytest.raises(ValueError, match="trace"):
        load_predictor({"name": "oracle", "kind": "oracle"})
    with pytest.raises(Exception, match="kind"):
        load_predictor({"name": "x", "kind": "crystal_ball"})


# ---- LLaPor loss ------------------------------------------------------------------------------------------------
def test_hybrid_loss_is_the_papers_formula() -> None:
    # one token, one expert, logit 0 (p = 0.5), active, f = 0.5, lambda = 1, gamma = 2:
    # BCE = ln 2; L_expert = ln 2 / 0.5; L_focal = (1 - 0.5)^2 ln 2 -> 2.25 ln 2
    one = hybrid_loss(np.zeros((1, 1), np.float32), np.ones((1, 1), np.float32), np.array([2.0], np.float32), 1.0, 2.0)
    assert float(one) == pytest.approx(2.25 * math.log(2), rel=1e-6)
    logits = np.array([[0.5, -1.0, 2.0], [0.0, 1.5, -0.5]])
    y = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    f = np.array([0.5, 0.25, 0.8])
    lam, gamma = 0.5, 2.0
    total = 0.0
    for t in range(2):
        l_expert = l_focal = 0.0
        for i in range(3):
            p = 1 / (1 + math.exp(-logits[t, i]))
            bce = -(y[t, i] * math.log(p) + (1 - y[t, i]) * math.log(1 - p))
            p_t = p if y[t, i] == 1 else 1 - p
            l_expert += bce / f[i] / 3
            l_focal += (1 - p_t) ** gamma * bce / 3
        total += (l_expert + lam * l_focal) / 2
    f32 = [np.asarray(a, np.float32) for a in (logits, y, 1 / f)]
    assert float(hybrid_loss(*f32, lam, gamma)) == pytest.approx(total, rel=1e-5)


# ---- LLaPor training, online fine-tuning, checkpoints ---------------------------------------------------------
@pytest.fixture(scope="module")
def llapor_fit():
    """LLaPor trained on the shift-by-1 rule (manual groups: input [1], middle [2], output [3])."""
    from predictors.llapor import fit_llapor
    from predictors.groups import layer_groups

    trace = shift_rule_trace(np.random.default_rng(5), n_seq=24, signal=1.0)
    split = split_rows(trace, 0.25, 0.0, seed=0)
    cfg = _cfg("llapor", **{"train.epochs": 12, "train.batch_size": 32, "llapor.groups.mode": "manual",
                            "llapor.groups.input": "[1]", "llapor.groups.output": "[3]", "llapor.input.optim.lr": 0.01,
                            "llapor.input.optim.warmup_epochs": 1, "llapor.middle.optim.lr": 0.01})
    groups = layer_groups(cfg.llapor.groups, trace, split.train)
    pred, losses = fit_llapor(trace, split.train, cfg, groups)
    return trace, split, cfg, groups, pred, losses


def test_llapor_learns_the_routing_rule_and_beats_stats(llapor_fit) -> None:
    trace, split, cfg, groups, pred, losses = llapor_fit
    assert groups.as_dict() == {"input": [1], "middle": [2], "output": [3]}
    assert pred.layers[2].group is LayerGroup.middle and len(pred.layers[2].net["residual"]) == 1
    assert len(pred.layers[1].net["residual"]) == 0 and pred.layers[1].comps.shape == (16, 16)
    assert all(l[-1] < l[0] for l in losses.values())
    res = evaluate_offline(pred, trace, split.test, groups.as_dict())
    stats = evaluate_offline(StatsPredictor.fit(trace, split.train), trace, split.test, groups.as_dict())
    assert res["groups"]["all"]["hit"] > 0.95 > 0.5 > stats["groups"]["all"]["hit"]


def test_llapor_forecasts_in_numpy_equal_the_jitted_net(llapor_fit) -> None:
    """Serving forecasts run the net in numpy; training and the paper's formulas run it in JAX."""
    import jax

    from predictors.data import routing_vector
    from predictors.llapor import llapor_logits

    trace, split, cfg, groups, pred, losses = llapor_fit
    rows = np.arange(37)
    for target in (1, 2):  # no residual block (input group), a gated residual block (middle group)
        ctx = trace_context(trace, target - 1, rows)
        arrays = pred.layers[target].arrays()
        routing = routing_vector(ctx.experts, ctx.weights, pred.num_experts)
        jitted = jax.nn.sigmoid(llapor_logits(arrays["net"], arrays["mean"], arrays["comps"], ctx.hidden, routing))
        np.testing.assert_allclose(pred.scores(target, ctx), np.asarray(jitted), atol=1e-5)


def test_online_monitor_triggers_only_above_threshold_over_a_full_window() -> None:
    spec = OnlineSpec()  # the paper's numbers: window 64, threshold 10 %, buffer 128
    assert (spec.window, spec.threshold, spec.buffer) == (64, 0.10, 128)
    mon = OnlineMonitor(spec, (3,))
    feats = lambda n, start: np.arange(start, start + n, dtype=np.float32)[:, None].repeat(3, axis=1)  # noqa: E731
    assert not mon.push(np.ones(63), feats(63, 0))  # 100 % error but only 63 tokens seen
    assert mon.push(np.ones(1), feats(1, 63))  # the 64th token fills the window
    mon.start_over()
    errs = np.zeros(64)
    errs[:12] = 0.5  # mean 6 / 64 = 9.4 %: below the threshold
    assert not mon.push(errs, feats(64, 64))
    errs[:14] = 0.5  # the window now holds only these 64 tokens: 7 / 64 = 10.9 %
    assert mon.push(errs, feats(64, 128))
    (buf,), mask = mon.batch()
    assert mask.sum() == 128  # 192 tokens pushed: the last 128, oldest first
    np.testing.assert_array_equal(buf[:, 0], np.arange(64, 192))
    np.testing.assert_array_equal(token_errors(np.array([[0, 1], [2, 3]]), np.array([[1, 5], [2, 3]])), [0.5, 0.0])


def test_llapor_online_fine_tunes_input_layers_on_shifted_routing_only(llapor_fit) -> None:
    from predictors.llapor import LayerNet, LLaPorPredictor

    trace, split, cfg, groups, trained, _ = llapor_fit
    cfg = copy.deepcopy(cfg)
    cfg.llapor.online.lr = 3e-3  # a brisk learner: the mechanism, not the shipped rate, is under test

    def clone() -> LLaPorPredictor:
        layers = {t: LayerNet(l.group, l.net, l.mean, l.comps, l.inv_freq) for t, l in trained.layers.items()}
        return LLaPorPredictor("llapor", cfg, trace.num_layers, 8, 2, groups, layers)

    same = clone()
    evaluate_online(same, trace, split.test, groups.as_dict())  # the rule it learned: errors stay below 10 %
    assert same.online_cycles().get(1, 0) == 0
    shifted = shift_rule_trace(np.random.default_rng(6), n_seq=24, shift=3, signal=1.0)
    pred = clone()
    before = {t: np.array(pred.layers[t].net["out"]["w"]) for t in pred.targets}
    res = evaluate_online(pred, shifted, np.ones(shifted.num_rows, bool), groups.as_dict())
    assert pred.online_cycles()[1] >= 1 and set(pred.online_cycles()) == {1}  # input group only
    after = pred.layer_arrays()
    assert not np.allclose(after[1]["net"]["out"]["w"], before[1])
    np.testing.assert_array_equal(after[2]["net"]["out"]["w"], before[2])
    np.testing.assert_array_equal(after[3]["net"]["out"]["w"], before[3])
    frozen = evaluate_offline(trained, shifted, np.ones(shifted.num_rows, bool), groups.as_dict())
    assert res["layers"][1]["hit"] > frozen["layers"][1]["hit"] + 0.1
    # the buffer holds the last 128 tokens the input layer saw
    (hidden, _, _), mask = pred.monitor(1).batch()
    np.testing.assert_array_equal(hidden, shifted.hidden[0, -128:].astype(np.float32))


def test_llapor_warm_up_compiles_the_online_step_and_changes_no_net(llapor_fit) -> None:
    from engine.offload.timer import compile_count
    from predictors.llapor import LayerNet, LLaPorPredictor

    trace, _, cfg, groups, trained, _ = llapor_fit
    cfg = copy.deepcopy(cfg)
    cfg.llapor.online.lr = 1.5e-3  # a rate no other test uses: this test's step is not compiled yet
    layers = {t: LayerNet(l.group, l.net, l.mean, l.comps, l.inv_freq) for t, l in trained.layers.items()}
    pred = LLaPorPredictor("llapor", cfg, trace.num_layers, 8, 2, groups, layers)
    before = {t: np.array(pred.layers[t].net["out"]["w"]) for t in pred.targets}
    compiled = compile_count()
    pred.warm_up()
    assert compile_count() > compiled  # the step of the input group compiled here
    for t, w in before.items():
        np.testing.assert_array_equal(pred.layer_arrays()[t]["net"]["out"]["w"], w)
    ctx = trace_context(trace, 0, np.arange(128))
    mon = pred.monitor(1)
    mon.push(np.ones(128), ctx.hidden.astype(np.float32), np.ones((128, 8), np.float32), np.ones((128, 8), np.float32))
    compiled = compile_count()
    pred.fine_tune(1)
    assert compile_count() == compiled  # the first real cycle compiles nothing
    assert not np.allclose(pred.layer_arrays()[1]["net"]["out"]["w"], before[1])


def test_orbax_round_trip_through_load_predictor(llapor_fit, tmp_path: Path) -> None:
    from predictors.moeless import MoElessPredictor
    from predictors.token import fit_token

    trace, split, cfg, groups, llapor, _ = llapor_fit
    token, _ = fit_token(trace, split.train, _cfg("token", **{"train.epochs": 1}),
                         np.random.default_rng(0).standard_normal((512, 16)))
    mcfg = _moeless_model_cfg(16)
    kernels = {t: np.random.default_rng(t).standard_normal((16, 8)).astype(np.float32) for t in (1, 2, 3)}
    moeless = MoElessPredictor("moeless@d1", 1, mcfg, kernels, {t: np.zeros(8, np.float32) for t in kernels},
                               {1: {"before": 0.5, "after": 0.9, "tuned": True, "epochs": 3}})
    ctx = trace_context(trace, 1, np.flatnonzero(split.test)[:64])
    llapor.prior_hit = {1: 0.5, 2: 0.75, 3: 1.0}
    for pred in (llapor, token, moeless, StatsPredictor.fit(trace, split.train)):
        folder = save_predictor(pred, tmp_path / pred.kind)
        back = load_predictor({"name": pred.name, "kind": pred.kind, "checkpoint": str(folder)})
        assert type(back) is type(pred) and back.targets == pred.targets
        np.testing.assert_allclose(back.predict(ctx), pred.predict(ctx), rtol=1e-6, atol=1e-7)
        assert back.memory_mb() == pytest.approx(pred.memory_mb())
    back = load_predictor({"name": "l", "kind": "llapor", "checkpoint": str(tmp_path / "llapor")})
    assert back.hit_rate(2) == 0.75 and back.hit_rate() == 0.75  # offline figures until run-time evidence
    back.observe(2, ctx, trace.experts[2, ctx.rows], predicted=trace.experts[2, ctx.rows])
    assert back.hit_rate(2) == 1.0 and back.hit_rate(1) == 0.5
    tuned = load_predictor({"name": "m", "kind": "moeless", "checkpoint": str(tmp_path / "moeless")})
    assert tuned.profile[1]["tuned"] is True
    with pytest.raises(ValueError, match="holds a llapor predictor"):
        load_predictor({"name": "x", "kind": "token", "checkpoint": str(tmp_path / "llapor")})
    with pytest.raises(PredictorCheckpointError, match="predictor.json"):
        load_predictor({"name": "x", "kind": "llapor", "checkpoint": str(tmp_path / "nowhere")})


# ---- MoEless ----------------------------------------------------------------------------------------------------
def _moeless_model_cfg(hidden: int, layers: int = 4):
    """tiny_mixtral's routing (softmax top-2 of 8) at another hidden size and depth."""
    from models.loading import resolve_model_config

    cfg = resolve_model_config(compose("record", ["model=tiny_mixtral"]).model)
    return cfg.replace(hidden_size=hidden, num_hidden_layers=layers)


def test_moeless_fine_tunes_only_the_layers_below_h() -> None:
    import jax.numpy as jnp

    from models.moe import route
    from predictors.moeless import copy_accuracy, fit_moeless

    rng = np.random.default_rng(7)
    H, E = 16, 8
    mcfg = _moeless_model_cfg(H, layers=3)
    trace = shift_rule_trace(rng, num_layers=3, hidden=H, n_seq=24, rows_per_seq=48)
    kernels = [rng.standard_normal((H, E)).astype(np.float32) for _ in range(3)]
    other = rng.standard_normal((H, E)).astype(np.float32)
    src = trace.hidden.astype(np.float32)
    # layer 1 routes exactly as its copy predicts from layer 0; layer 2 by a kernel its copy does not know
    for target, kernel in ((1, kernels[1]), (2, other)):
        r = route(mcfg, jnp.asarray(src[target - 1] @ kernel))
        trace.experts[target] = np.asarray(r.experts)
        trace.weights[target] = np.asarray(r.weights)
    split = split_rows(trace, 0.25, 0.2, seed=0)
    cfg = _cfg("moeless", **{"moeless.max_epochs": 30, "moeless.lr": 0.05, "moeless.metric": "hit"})
    biases = [np.zeros(E, np.float32)] * 3
    pred = fit_moeless(trace, split.train, split.val, cfg, mcfg, kernels, biases)
    assert pred.profile[1]["before"] >= 0.8 and not pred.profile[1]["tuned"]
    np.testing.assert_array_equal(np.asarray(pred.kernels[1]), kernels[1])  # above h: left as copied
    assert pred.profile[2]["before"] < 0.8 and pred.profile[2]["tuned"]
    test2 = layer_pairs(trace, 1, 1, split.test)
    raw = copy_accuracy(mcfg, kernels[2], biases[2], test2, cfg.moeless.metric)
    tuned = copy_accuracy(mcfg, pred.kernels[2], biases[2], test2, cfg.moeless.metric)
    assert pred.profile[2]["after"] >= 0.8 and tuned > raw + 0.2


# ---- groups ------------------------------------------------------------------------------------------------------
def test_middle_group_is_the_best_interior_segment() -> None:
    # targets 1..6, scores: the run 3..5 (0.5 + 2 + 1) is the best interior segment
    assert split_by_score([1, 2, 3, 4, 5, 6], np.array([3.0, -1.0, 0.5, 2.0, 1.0, 5.0])) == ((1, 2), (3, 4, 5), (6,))
    assert split_by_score([1, 2], np.array([1.0, 2.0])) == ((1,), (), (2,))
    g = groups_from_spec(GroupsSpec(mode=GroupMode.manual, input=[1], output=[5, 6]), 7)
    assert g.as_dict() == {"input": [1], "middle": [2, 3, 4], "output": [5, 6]} and g.of(4) is LayerGroup.middle
    with pytest.raises(ValueError, match="llapor.groups.output"):
        groups_from_spec(GroupsSpec(mode=GroupMode.manual, output=[9]), 7)


def test_groups_from_data_put_high_similarity_low_correlation_layers_in_the_middle() -> None:
    from predictors.groups import groups_from_data

    rng = np.random.default_rng(8)
    trace = shift_rule_trace(rng, num_layers=6, n_seq=16)
    base = rng.standard_normal((trace.num_rows, 16))
    for layer in range(6):  # gate inputs of layers 1..4 nearly equal; layers 0 and 5 unrelated
        trace.hidden[layer] = (base + (0.05 if 1 <= layer <= 4 else 3.0) * rng.standard_normal(base.shape)).astype(np.float16)
    for layer in (2, 3, 4):  # routing of the middle targets no longer follows the previous layer
        trace.experts[layer] = np.stack([rng.choice(8, 2, replace=False) for _ in range(trace.num_rows)])
    trace.experts[5] = (trace.experts[4] + 1) % 8
    g = groups_from_data(trace, np.ones(trace.num_rows, bool))
    assert g.as_dict() == {"input": [1], "middle": [2, 3, 4], "output": [5]}
    assert g.stats["similarity"][2] > 0.9 > g.stats["similarity"][4]


def test_host_forecasts_run_on_one_blas_thread_and_restore_it() -> None:
    from threadpoolctl import threadpool_info, threadpool_limits

    from predictors.nets import one_blas_thread

    blas_threads = lambda: [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]  # noqa: E731

    @one_blas_thread
    def inside() -> list[int]:
        return blas_threads()

    with threadpool_limits(limits=2, user_api="blas"):
        assert blas_threads() and set(blas_threads()) == {2}  # numpy's BLAS is loaded and visible
        assert set(inside()) == {1}
        assert set(blas_threads()) == {2}


def test_gate_predictors_of_every_distance_share_one_router_copy_and_no_device_copy() -> None:
    """The gate predictors at d = 1..3 of one model read one float32 copy of its routers (read-only), and a
    host-routable family's forecasts make no device copy of them (at a full-depth Qwen3-30B-A3B each was 50 MB)."""
    from models.config import Family, ModelConfig
    from models.transformer import build_model
    from predictors.gate import GatePredictor, gate_copies

    cfg = ModelConfig(family=Family.mixtral, vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, num_experts=8, num_experts_per_tok=2)
    model = build_model(cfg, seed=1, with_experts=False)
    gates = [GatePredictor.from_model(model, d) for d in (1, 2, 3)]
    kernels, _ = gate_copies(model)
    for gate in gates:
        for t in gate.targets:
            assert gate.host_kernels[t] is kernels[t] and not kernels[t].flags.writeable
    h = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    ctx = LayerContext(layer=0, step=0, experts=np.zeros((5, 1), np.int64), weights=np.ones((5, 1), np.float32),
                       hidden=h)
    expected = topk_experts(h @ np.asarray(model.layers[1].moe.router.weight[...], np.float32).T, 2)
    np.testing.assert_array_equal(np.sort(gates[0].predict_topk(ctx), axis=1), np.sort(expected, axis=1))
    assert all(gate._device is None for gate in gates)
