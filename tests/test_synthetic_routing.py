"""The synthetic routing generator: the structure it promises is measurable in what it produces."""

from __future__ import annotations

import numpy as np
import pytest

from engine.synthetic_routing import LayerGroupParams, SyntheticRouter, SyntheticRoutingParams
from core.trace import DECODE, PREFILL


def uniform_params(**kw) -> SyntheticRoutingParams:
    g = LayerGroupParams(**{"popularity_sigma": 0.0, "layer_correlation": 0.0, "temporal_locality": 0.0,
                            "weight_concentration": 1.0, **kw})
    return SyntheticRoutingParams(input=g, middle=g, output=g)


def test_trace_shape_and_validity() -> None:
    r = SyntheticRouter(6, 16, 4, model_seed=1)
    tr = r.trace(batch=3, prompt_len=5, gen_len=4, seed=2, num_batches=2)
    assert tr.num_layers == 6 and tr.meta.top_k == 4
    assert tr.num_steps == 2 * (1 + 3)  # per batch: one prefill, gen_len - 1 decode steps
    assert (tr.phase[tr.step == 0] == PREFILL).all() and (tr.phase[tr.step == 1] == DECODE).all()
    srt = np.sort(tr.experts, axis=2)
    assert not (srt[..., 1:] == srt[..., :-1]).any()  # top-k experts are distinct per token
    assert np.allclose(tr.weights.sum(axis=2), 1.0, atol=1e-5)
    assert (np.diff(tr.weights, axis=2) <= 1e-7).all()  # sorted, largest first
    assert r.groups == ["input", "input", "middle", "middle", "output", "output"]


def test_same_seeds_same_trace_and_model_seed_fixes_hot_experts() -> None:
    a = SyntheticRouter(4, 32, 2, model_seed=7).trace(4, 16, 3, seed=5)
    b = SyntheticRouter(4, 32, 2, model_seed=7).trace(4, 16, 3, seed=5)
    assert np.array_equal(a.experts, b.experts)
    # different traffic of the same model: the hottest experts of a layer agree far above chance (a skewed
    # model: the fitted defaults' popularity spread, 0.35, leaves 32 experts' top-4 close to noise)
    r = SyntheticRouter(4, 32, 2, uniform_params(popularity_sigma=1.0), model_seed=7)
    la, lb = r.trace(16, 64, 2, seed=1).expert_loads(), r.trace(16, 64, 2, seed=2).expert_loads()
    overlap = np.mean([len(set(np.argsort(-la[l])[:4]) & set(np.argsort(-lb[l])[:4])) for l in range(4)])
    assert overlap >= 2.5


def test_popularity_skew_raises_load_imbalance() -> None:
    flat = SyntheticRouter(4, 64, 4, uniform_params(), model_seed=0).trace(32, 64, 2, seed=0).expert_loads()
    skew = SyntheticRouter(4, 64, 4, uniform_params(popularity_sigma=1.5), model_seed=0).trace(32, 64, 2, seed=0).expert_loads()
    cv = lambda x: float(np.mean(x.std(axis=1) / x.mean(axis=1)))  # noqa: E731
    assert cv(flat) < 0.2 < 0.8 < cv(skew)


def test_layer_correlation_makes_the_next_layer_predictable() -> None:
    for corr, lo, hi in [(0.0, 0.0, 0.1), (0.8, 0.7, 0.9)]:
        r = SyntheticRouter(3, 64, 2, uniform_params(layer_correlation=corr), model_seed=3)
        tr = r.trace(8, 128, 2, seed=4)
        follows = np.mean(r.affinity[1][tr.experts[0].astype(int)] == tr.experts[1])
        assert lo <= follows <= hi, (corr, follows)


def test_temporal_locality_repeats_the_previous_position() -> None:
    for loc, lo, hi in [(0.0, 0.0, 0.1), (0.6, 0.5, 0.75)]:
        r = SyntheticRouter(2, 64, 2, uniform_params(temporal_locality=loc), model_seed=3)
        tr = r.trace(8, 64, 32, seed=4)
        dec = tr.phase == DECODE
        steps = np.unique(tr.step[dec])
        same = []
        for s0, s1 in zip(steps[:-1], steps[1:]):
            a, b = tr.experts[0, tr.step == s0], tr.experts[0, tr.step == s1]  # same sequence order each step
            same.append(np.mean(a == b))
        assert lo <= np.mean(same) <= hi, (loc, np.mean(same))


def test_bad_parameters_name_the_key() -> None:
    with pytest.raises(ValueError, match="routing.synthetic.input.layer_correlation: must lie in"):
        SyntheticRouter(4, 8, 2, uniform_params(layer_correlation=1.5))
    with pytest.raises(ValueError, match="top_k"):
        SyntheticRouter(4, 8, 9)
    with pytest.raises(ValueError, match="input_fraction"):
        SyntheticRouter(4, 8, 2, SyntheticRoutingParams(input_fraction=0.8, output_fraction=0.5))


def test_request_domains_draw_from_their_own_popularity_and_keep_it_while_decoding() -> None:
    params = SyntheticRoutingParams(input=LayerGroupParams(0.0, 0.0, 0.0, 1.0, domain_sigma=1.5),
                                    middle=LayerGroupParams(0.0, 0.0, 0.0, 1.0, domain_sigma=1.5),
                                    output=LayerGroupParams(0.0, 0.0, 0.0, 1.0, domain_sigma=1.5), num_domains=3)
    r = SyntheticRouter(3, 16, 1, params, model_seed=4)  # top-1: no duplicate redraws bias the shares
    assert np.allclose(r.domain_popularity.mean(axis=1), r.popularity)
    rng = np.random.default_rng(0)
    for domain in range(3):
        domains = np.full(64, domain)
        ex, _ = r.prefill(64, 64, rng, domains)
        shares = np.bincount(ex[1].reshape(-1), minlength=16) / ex[1].size
        assert np.abs(shares - r.domain_popularity[1, domain]).max() < 0.02
        last = ex[:, 63::64]
        counts = np.zeros(16)
        for _ in range(32):
            last, _ = r.decode(last, rng, domains)
            counts += np.bincount(last[1].reshape(-1), minlength=16)
        assert np.abs(counts / counts.sum() - r.domain_popularity[1, domain]).max() < 0.03
    with pytest.raises(ValueError, match="domains must be 4 ints in \\[0, num_domains=3\\)"):
        r.prefill(4, 2, rng, np.array([0, 1, 2, 3]))


def test_request_domains_make_batch_loads_vary_over_time() -> None:
    def batch_share_spread(num_domains: int) -> float:
        g = LayerGroupParams(popularity_sigma=0.5, layer_correlation=0.0, temporal_locality=0.0, domain_sigma=1.0)
        r = SyntheticRouter(2, 8, 2, SyntheticRoutingParams(input=g, middle=g, output=g, num_domains=num_domains),
                            model_seed=1)
        tr = r.trace(batch=2, prompt_len=256, gen_len=1, seed=3, num_batches=40)  # one prefill step per batch
        loads = np.stack([tr.expert_loads(tr.step == s) for s in range(40)])
        shares = loads / loads.sum(axis=-1, keepdims=True)  # [batches, L, E]
        return float(shares.std(axis=0).mean())

    assert batch_share_spread(1) < 0.02 < 0.04 < batch_share_spread(8)


def test_one_domain_draws_nothing_extra_and_bad_domain_settings_fail() -> None:
    r = SyntheticRouter(2, 8, 2, model_seed=0)
    assert r.request_domains(5, np.random.default_rng(0)) is None and r.domain_popularity.shape == (2, 1, 8)
    with pytest.raises(ValueError, match="routing.synthetic.num_domains"):
        SyntheticRoutingParams(num_domains=0).validate()
    with pytest.raises(ValueError, match="routing.synthetic.middle.domain_sigma"):
        SyntheticRoutingParams(middle=LayerGroupParams(domain_sigma=-1.0)).validate()
