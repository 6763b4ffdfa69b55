"""Traces recorded from generation hold exactly the real tokens, with the routing a plain forward gives them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from conf import compose
from engine.recording import record_generation, trace_meta
from core.trace import DECODE, PREFILL, RoutingTrace, TraceRecorder
from models.generation import Generator
from models.loading import resolve_model_config
from models.transformer import build_model, forward_jit, init_cache


def test_recorded_trace_matches_teacher_forced_routing(tmp_path) -> None:
    cfg = resolve_model_config(compose("generate", ["model=tiny_moonlight"]).model)
    model = build_model(cfg, seed=3)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in (4, 11)]
    out = Generator(model, capture=True, capture_hidden=True).generate(prompts, 6)
    recorder = TraceRecorder(trace_meta(cfg, "tiny-moonlight", "test"), keep_hidden=True)
    record_generation(recorder, out, prompts, seq_ids=[10, 11])
    trace = RoutingTrace.load(recorder.build().save(tmp_path / "t.npz"))

    assert trace.num_rows == sum(map(len, prompts)) + int((out.lengths - 1).sum())
    assert trace.num_steps == 1 + int(out.lengths.max()) - 1
    assert set(trace.phase[trace.step == 0]) == {PREFILL} and set(trace.phase[trace.step > 0]) == {DECODE}
    fulls = [prompt + out.tokens[b, : out.lengths[b] - 1].tolist() for b, prompt in enumerate(prompts)]
    n = max(map(len, fulls))  # one compiled length: causal attention leaves a prefix unchanged by what follows it
    for b, full in enumerate(fulls):  # every token the model consumed
        padded = full + [full[-1]] * (n - len(full))
        _, _, cap = forward_jit(model, jnp.asarray([padded]), init_cache(model, 1, n), jnp.arange(n)[None],
                                capture=True, capture_hidden=True)
        rows = np.flatnonzero(trace.seq == 10 + b)
        order = np.argsort(trace.pos[rows])
        rows = rows[order]
        np.testing.assert_array_equal(trace.pos[rows], np.arange(len(full)))
        np.testing.assert_array_equal(trace.token[rows], full)
        experts, weights, hidden = (np.asarray(a)[:, 0, :len(full)] for a in (cap.experts, cap.weights, cap.hidden))
        np.testing.assert_array_equal(np.sort(trace.experts[:, rows], -1), np.sort(experts, -1))
        np.testing.assert_allclose(np.sort(trace.weights[:, rows], -1), np.sort(weights, -1), atol=1e-5)
        np.testing.assert_allclose(trace.hidden[:, rows].astype(np.float32), hidden, atol=2e-2)
