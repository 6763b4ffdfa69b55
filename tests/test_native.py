"""models.native: the compiled CPU kernels (FFI in jitted JAX, ctypes on host arrays) against float64 numpy
references that apply the same bf16 roundings, on every ISA path this CPU has (AMX, AVX512-BF16, AVX2, scalar).

Tolerances are element-wise bounds: a bf16 result may differ from the rounded float64 one by one bf16
step (2^-7 relative), a SwiGLU output by at most the effect of every h element one bf16 step off
(2^-7 of sum_f |h_f| |down_f|; in practice a few h elements flip, if any), an f32 result by f32
accumulation error (1e-5 of the sum of |products|). A wrong index or stride moves an output by a sizeable
fraction of those sums, far outside the bounds (checked by breaking the kernels on purpose).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from models import native
from models.native import build
from tests.conftest import NATIVE_ISAS as ISAS

BF16 = ml_dtypes.bfloat16
ROOT = Path(__file__).resolve().parents[1]

needs_native = pytest.mark.skipif(not native.available(), reason=f"native library unavailable: {native.build_error()}")


@pytest.fixture
def threads_default():
    before = native.get_threads()
    yield
    native.set_threads(before)


# ---- float64 references ------------------------------------------------------------------------

def rbf(a: np.ndarray) -> np.ndarray:
    """Round (via f32) to bf16 and back to float64."""
    return np.asarray(a, np.float64).astype(np.float32).astype(BF16).astype(np.float64)


def f64(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.float().numpy().astype(np.float64)
    return np.asarray(a).astype(np.float64)


def ref_linear(x, w):
    """(y, bound scale): y = x w^T in float64 and sum |x||w| per output."""
    x, w = f64(x), f64(w)
    return x @ w.T, np.abs(x) @ np.abs(w).T


def ref_expert(x, gate, up, down, low: bool):
    """(y, scale) of one SwiGLU expert in float64, with the bf16 roundings of g, u and h when `low`."""
    x, gate, up, down = f64(x), f64(gate), f64(up), f64(down)
    g, u = x @ gate.T, x @ up.T
    if low:
        g, u = rbf(g), rbf(u)
    h = g / (1.0 + np.exp(-g)) * u
    if low:
        h = rbf(h)
    return h @ down.T, np.abs(h) @ np.abs(down).T


def assert_close(y, ref, scale, rel):
    y = np.asarray(y, np.float64)
    bound = rel * scale + 1e-6
    err = np.abs(y - ref)
    assert y.shape == ref.shape
    if err.size and not np.all(err <= bound):
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(f"max err {err.max():.3g}, worst at {worst} ({err[worst]:.3g} > {bound[worst]:.3g})")


def rand(rng, shape, dtype, std=1.0):
    return (rng.standard_normal(shape) * std).astype(dtype)


# ---- JAX wrappers (XLA FFI) ----------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 37])
def test_linear_jit_bf16(isa, m):
    rng = np.random.default_rng(m)
    K, N = 72, 40
    x, w = rand(rng, (m, K), BF16), rand(rng, (N, K), BF16, 0.2)
    y = jax.jit(native.linear)(jnp.asarray(x), jnp.asarray(w))
    assert y.shape == (m, N) and y.dtype == jnp.bfloat16
    ref, scale = ref_linear(x, w)
    # the f32 sum rounded once: the float64 result rounded to bf16, or one bf16 step away
    assert_close(y, rbf(ref), np.abs(ref), 2.0 ** -7)
    if m:
        assert np.mean(np.asarray(y, np.float64) == rbf(ref)) > 0.9
        assert_close(y, np.asarray(native.linear_reference(jnp.asarray(x), jnp.asarray(w)), np.float64),
                     np.abs(ref), 2.0 ** -7)


@needs_native
@pytest.mark.parametrize("m", [0, 1, 2, 3, 5, 37])
def test_linear_jit_f32_and_batch_dims(isa, m):
    rng = np.random.default_rng(10 + m)
    K, N = 33, 17
    x, w = rand(rng, (2, m, K), np.float32), rand(rng, (N, K), np.float32)
    y = jax.jit(native.linear)(jnp.asarray(x), jnp.asarray(w))
    assert y.shape == (2, m, N) and y.dtype == jnp.float32
    ref, scale = ref_linear(x.reshape(-1, K), w)
    assert_close(np.asarray(y).reshape(-1, N), ref, scale, 1e-5)


@needs_native
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 37])
def test_swiglu_jit_bf16(isa, m):
    rng = np.random.default_rng(20 + m)
    H, F = 72, 40
    x = rand(rng, (m, H), BF16)
    gate_up, down = rand(rng, (2 * F, H), BF16, 0.2), rand(rng, (H, F), BF16, 0.2)
    y = jax.jit(native.swiglu)(jnp.asarray(x), jnp.asarray(gate_up), jnp.asarray(down))
    assert y.shape == (m, H) and y.dtype == jnp.float32
    ref, scale = ref_expert(x, gate_up[:F], gate_up[F:], down, low=True)
    assert_close(y, ref, scale, 2.0 ** -7)
    xla = native.swiglu_reference(jnp.asarray(x), jnp.asarray(gate_up), jnp.asarray(down))
    assert_close(y, np.asarray(xla, np.float64), scale, 2.0 ** -7)


@needs_native
@pytest.mark.parametrize("m", [1, 4, 9])
def test_swiglu_jit_f32(isa, m):
    rng = np.random.default_rng(30 + m)
    H, F = 40, 72
    x = rand(rng, (3, m, H), np.float32)
    gate_up, down = rand(rng, (2 * F, H), np.float32, 0.3), rand(rng, (H, F), np.float32, 0.3)
    y = jax.jit(native.swiglu)(jnp.asarray(x), jnp.asarray(gate_up), jnp.asarray(down))
    ref, scale = ref_expert(x.reshape(-1, H), gate_up[:F], gate_up[F:], down, low=False)
    assert_close(np.asarray(y).reshape(-1, H), ref, scale, 1e-5)


@needs_native
@pytest.mark.parametrize("m", [9, 13])
def test_long_rows(isa, m):
    """K over the 2048-element chunk the kernels walk for M > 8 (partial sums carried between chunks)."""
    rng = np.random.default_rng(35 + m)
    H, F = 2100, 24
    x = rand(rng, (m, H), BF16)
    gate_up, down = rand(rng, (2 * F, H), BF16, 0.05), rand(rng, (H, F), BF16, 0.2)
    y = jax.jit(native.linear)(jnp.asarray(x), jnp.asarray(gate_up))
    ref, scale = ref_linear(x, gate_up)
    assert_close(y, rbf(ref), np.abs(ref), 2.0 ** -7)
    y = jax.jit(native.swiglu)(jnp.asarray(x), jnp.asarray(gate_up), jnp.asarray(down))
    ref, scale = ref_expert(x, gate_up[:F], gate_up[F:], down, low=True)
    assert_close(y, ref, scale, 2.0 ** -7)


@needs_native
def test_control_flow_switch_and_while(isa):
    rng = np.random.default_rng(40)
    H, F, m = 72, 40, 3
    x = jnp.asarray(rand(rng, (m, H), BF16))
    gate_up, down = jnp.asarray(rand(rng, (2 * F, H), BF16, 0.2)), jnp.asarray(rand(rng, (H, F), BF16, 0.2))
    w = jnp.asarray(rand(rng, (H, H), BF16, 0.15))

    def branches(lin, glu):
        return [lambda x: glu(x, gate_up, down), lambda x: lin(x, w).astype(jnp.float32)]

    @jax.jit
    def program(i, x):
        y = jax.lax.switch(i, branches(native.linear, native.swiglu), x)
        z = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, native.linear(c[1], w)), (0, x))[1]
        c = jax.lax.cond(i == 0, lambda x: native.swiglu(x, gate_up, down), lambda x: x.astype(jnp.float32), x)
        return y, z, c

    for i in (0, 1):
        y, z, c = program(i, x)
        ref_y = branches(native.linear_reference, native.swiglu_reference)[i](x)
        scale = np.abs(np.asarray(ref_y, np.float64)).max()
        assert np.abs(np.asarray(y, np.float64) - np.asarray(ref_y, np.float64)).max() <= 2e-2 * scale
        ref_z = x
        for _ in range(3):
            ref_z = native.linear_reference(ref_z, w)
        assert np.abs(np.asarray(z, np.float64) - np.asarray(ref_z, np.float64)).max() <= 3e-2 * np.abs(
            np.asarray(ref_z, np.float64)).max()
    assert np.array_equal(np.asarray(program(0, x)[2]), np.asarray(program(0, x)[0]))


@needs_native
def test_jax_wrappers_grad_and_other_backends():
    rng = np.random.default_rng(50)
    x = jnp.asarray(rand(rng, (4, 72), BF16))
    gate_up, down = jnp.asarray(rand(rng, (80, 72), BF16, 0.2)), jnp.asarray(rand(rng, (72, 40), BF16, 0.2))
    got = jax.grad(lambda x: native.swiglu(x, gate_up, down).sum())(x)
    want = jax.grad(lambda x: native.swiglu_reference(x, gate_up, down).sum())(x)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    # lowered for a GPU: XLA's own dots, no CPU custom call
    exported = jax.export.export(jax.jit(native.swiglu), platforms=["cuda"])(x, gate_up, down)
    assert "moescope" not in exported.mlir_module()
    assert "moescope_swiglu" in jax.jit(native.swiglu).lower(x, gate_up, down).as_text()


@needs_native
def test_ffi_threads_identical(threads_default):
    rng = np.random.default_rng(60)
    H, F = 256, 520  # over 256 KiB of weights per phase: the kernels split the rows over threads
    x = jnp.asarray(rand(rng, (5, H), BF16))
    gate_up, down = jnp.asarray(rand(rng, (2 * F, H), BF16, 0.1)), jnp.asarray(rand(rng, (H, F), BF16, 0.1))
    f = jax.jit(native.swiglu)
    outs = []
    for n in (1, 2, 3):
        native.set_threads(n)
        outs.append(np.asarray(f(x, gate_up, down)))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


# ---- host path (ctypes) --------------------------------------------------------------------------

def make_routing(rng, T, E, k, empty):
    """Top-k routing of T tokens over E experts (expert `empty` gets no pair), grouped by expert."""
    choices = [rng.choice([e for e in range(E) if e != empty], size=k, replace=False) for _ in range(T)]
    pairs = sorted((int(e), t) for t, es in enumerate(choices) for e in es)
    offsets = np.searchsorted([e for e, _ in pairs], np.arange(E + 1)).astype(np.int64)
    tokens = np.array([t for _, t in pairs], np.int32)
    weights = rng.uniform(0.1, 1.0, len(pairs)).astype(np.float32)
    return offsets, tokens, weights


def ref_experts(out0, x, gates, ups, downs, offsets, tokens, weights, low):
    out, scale = f64(out0).copy(), np.zeros(out0.shape)
    for e in range(len(gates)):
        for p in range(offsets[e], offsets[e + 1]):
            t = tokens[p]
            y, s = ref_expert(x[t:t + 1], gates[e], ups[e], downs[e], low)
            out[t] += weights[p] * y[0]
            scale[t] += weights[p] * s[0]
    return out, scale


def expert_weights(rng, E, H, F, dtype, std=0.2):
    return ([rand(rng, (F, H), dtype, std) for _ in range(E)], [rand(rng, (F, H), dtype, std) for _ in range(E)],
            [rand(rng, (H, F), dtype, std) for _ in range(E)])


@needs_native
@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
def test_experts_host(isa, dtype):
    rng = np.random.default_rng(70)
    T, H, F, E = 9, 72, 40, 5
    gates, ups, downs = expert_weights(rng, E, H, F, dtype)
    x = rand(rng, (T, H), dtype)
    offsets, tokens, weights = make_routing(rng, T, E, k=2, empty=3)
    assert offsets[3] == offsets[4]  # an expert without pairs; every token goes to two experts
    out0 = rand(rng, (T, H), np.float32)  # accumulated into, not overwritten
    low = dtype is BF16
    ref, scale = ref_experts(out0, x, gates, ups, downs, offsets, tokens, weights, low)
    results = []
    for threads in (1, 2):
        out = out0.copy()
        seconds = np.full(E, -1.0)
        native.experts_host(out, x, gates, ups, downs, offsets, tokens, weights, threads=threads, seconds=seconds)
        assert_close(out, ref, scale + np.abs(f64(out0)), 2.0 ** -7 if low else 1e-5)
        assert seconds[3] == 0.0 and np.all(seconds >= 0)
        results.append(out)
    assert np.array_equal(results[0], results[1])


@needs_native
@pytest.mark.parametrize("m", [1, 2, 3, 6])
def test_experts_host_threads_identical_large(m):
    rng = np.random.default_rng(80 + m)
    T, H, F, E = 8, 256, 520, 2  # per phase over 256 KiB of weights: threads really split the rows
    gates, ups, downs = expert_weights(rng, E, H, F, BF16, 0.1)
    x = rand(rng, (T, H), BF16)
    tokens = np.concatenate([np.arange(m), np.arange(T - 2, T)]).astype(np.int32)
    offsets = np.array([0, m, m + 2], np.int64)
    weights = rng.uniform(0.1, 1, m + 2).astype(np.float32)
    outs = []
    for threads in (1, 2, 3):
        out = np.zeros((T, H), np.float32)
        native.experts_host(out, x, gates, ups, downs, offsets, tokens, weights, threads=threads)
        outs.append(out)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    ref, scale = ref_experts(np.zeros((T, H), np.float32), x, gates, ups, downs, offsets, tokens, weights, True)
    assert_close(outs[0], ref, scale, 2.0 ** -7)


@needs_native
def test_experts_host_read_only_and_torch_weights(tmp_path):
    rng = np.random.default_rng(90)
    T, H, F, E = 6, 72, 40, 3
    gates, ups, downs = expert_weights(rng, E, H, F, BF16)
    # expert 0 from a file mapped read-only, expert 1 non-writeable numpy arrays, expert 2 torch bf16 tensors
    path = tmp_path / "experts.bin"
    with open(path, "wb") as f:
        for a in (gates[0], ups[0], downs[0]):
            f.write(a.tobytes())
    mm = np.memmap(path, dtype=BF16, mode="r")
    n = F * H
    mapped = [mm[:n].reshape(F, H), mm[n:2 * n].reshape(F, H), mm[2 * n:].reshape(H, F)]
    frozen = [a.copy() for a in (gates[1], ups[1], downs[1])]
    for a in frozen:
        a.flags.writeable = False
    tensors = [torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16) for a in (gates[2], ups[2], downs[2])]
    g2, u2, d2 = zip(mapped, frozen, tensors)
    x = rand(rng, (T, H), BF16)
    offsets, tokens, weights = make_routing(rng, T, E, k=2, empty=-1)
    out = np.zeros((T, H), np.float32)
    native.experts_host(out, x, list(g2), list(u2), list(d2), offsets, tokens, weights, threads=2)
    ref, scale = ref_experts(np.zeros((T, H), np.float32), x, gates, ups, downs, offsets, tokens, weights, True)
    assert_close(out, ref, scale, 2.0 ** -7)
    # packed once, run again: same result
    packed = native.pack_experts(list(g2), list(u2), list(d2))
    out2 = np.zeros((T, H), np.float32)
    native.experts_host(out2, x, packed, None, None, offsets, tokens, weights, threads=1)
    assert np.array_equal(out, out2)


def guarded(a: np.ndarray) -> np.ndarray:
    """A copy of `a` inside a buffer whose elements before and after are NaN: any read outside makes NaNs."""
    buf = np.full(a.size + 128, np.nan, a.dtype)
    out = buf[64:64 + a.size].reshape(a.shape)
    out[...] = a
    return out


@needs_native
@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
def test_no_reads_outside_the_arrays(isa, dtype):
    rng = np.random.default_rng(95)
    for K, N in ((37, 9), (71, 5), (8, 3), (2085, 6)):  # the last: K in several chunks of 2048 for M > 8
        w = guarded(rand(rng, (N, K), dtype))
        for m in (1, 2, 3, 5, 9, 13):
            x = guarded(rand(rng, (m, K), dtype))
            y = native.linear_host(x, w)
            ref, scale = ref_linear(x, w)
            assert_close(y, ref, scale, 1e-5)
    T, H, F = 9, 37, 11
    gates, ups, downs = (list(map(guarded, ws)) for ws in expert_weights(rng, 2, H, F, dtype))
    x = guarded(rand(rng, (T, H), dtype))
    offsets, tokens = np.array([0, 9, 11], np.int64), np.array(list(range(9)) + [8, 0], np.int32)
    weights = np.ones(11, np.float32)
    out = np.zeros((T, H), np.float32)
    native.experts_host(out, x, gates, ups, downs, offsets, tokens, weights)
    ref, scale = ref_experts(out * 0, x, gates, ups, downs, offsets, tokens, weights, dtype is BF16)
    assert_close(out, ref, scale, 2.0 ** -7 if dtype is BF16 else 1e-5)


@needs_native
def test_experts_host_rejects_bad_arguments():
    rng = np.random.default_rng(100)
    T, H, F = 4, 16, 8
    g, u, d = expert_weights(rng, 1, H, F, BF16)
    x = rand(rng, (T, H), BF16)
    out = np.zeros((T, H), np.float32)
    ok = dict(offsets=np.array([0, 2], np.int64), tokens=np.array([0, 3], np.int32),
              pair_weight=np.ones(2, np.float32))

    def call(**kw):
        args = dict(out=out, x=x, gates=g, ups=u, downs=d, **ok)
        args.update(kw)
        native.experts_host(args.pop("out"), args.pop("x"), args.pop("gates"), args.pop("ups"), args.pop("downs"),
                            **args)

    call()
    with pytest.raises(ValueError, match="x: dtype"):
        call(x=x.astype(np.float32))
    with pytest.raises(ValueError, match="expert 0 down: shape"):
        call(downs=[d[0].T.copy()])
    with pytest.raises(ValueError, match="C-contiguous"):
        call(gates=[np.asfortranarray(g[0])])
    with pytest.raises(ValueError, match="outside"):
        call(tokens=np.array([0, 4], np.int32))
    with pytest.raises(ValueError, match="tokens"):
        call(tokens=np.array([0, 3], np.int64))
    with pytest.raises(ValueError, match="offsets"):
        call(offsets=np.array([0, 3], np.int64))
    with pytest.raises(ValueError, match="out"):
        call(out=np.zeros((T, H), np.float64))
    with pytest.raises(ValueError, match="expected bfloat16"):
        call(gates=[g[0].astype(np.float16)], ups=[u[0].astype(np.float16)], downs=[d[0].astype(np.float16)])


@needs_native
@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
def test_linear_host(isa, dtype):
    rng = np.random.default_rng(110)
    for m in (1, 2, 3, 4, 11):
        x, w = rand(rng, (m, 72), dtype), rand(rng, (40, 72), dtype)
        y = native.linear_host(x, w, threads=2)
        ref, scale = ref_linear(x, w)
        assert y.dtype == np.float32
        assert_close(y, ref, scale, 1e-5)


@needs_native
def test_concurrent_callers(threads_default):
    """A jitted FFI expert and host experts on two Python threads at once give the serial results."""
    rng = np.random.default_rng(120)
    T, H, F, E = 5, 256, 520, 2
    gates, ups, downs = expert_weights(rng, E, H, F, BF16, 0.1)
    x = rand(rng, (T, H), BF16)
    offsets = np.array([0, 3, 5], np.int64)
    tokens = np.array([0, 1, 2, 2, 4], np.int32)
    weights = np.ones(5, np.float32)
    gate_up = jnp.asarray(np.concatenate([gates[0], ups[0]]))
    f = jax.jit(native.swiglu)
    native.set_threads(2)
    want_jax = np.asarray(f(jnp.asarray(x), gate_up, jnp.asarray(downs[0])))
    want_host = np.zeros((T, H), np.float32)
    native.experts_host(want_host, x, gates, ups, downs, offsets, tokens, weights, threads=2)
    errors = []

    def host():
        for _ in range(20):
            out = np.zeros((T, H), np.float32)
            native.experts_host(out, x, gates, ups, downs, offsets, tokens, weights, threads=2)
            if not np.array_equal(out, want_host):
                errors.append("host")

    def dev():
        for _ in range(20):
            if not np.array_equal(np.asarray(f(jnp.asarray(x), gate_up, jnp.asarray(downs[0]))), want_jax):
                errors.append("jax")

    # a layer through the experts FFI at the same time
    gu_j = [jnp.asarray(np.concatenate([g, u])) for g, u in zip(gates, ups)]
    dn_j = [jnp.asarray(d) for d in downs]
    layer = jax.jit(native.experts)
    lay_args = (jnp.asarray(x), jnp.asarray(tokens), jnp.asarray(weights), jnp.asarray(offsets.astype(np.int32)))
    want_layer = np.asarray(layer(*lay_args, gu_j, dn_j))
    assert np.array_equal(want_layer, want_host)

    def dev_layer():
        for _ in range(20):
            if not np.array_equal(np.asarray(layer(*lay_args, gu_j, dn_j)), want_layer):
                errors.append("jax layer")

    threads = [threading.Thread(target=host), threading.Thread(target=dev), threading.Thread(target=host),
               threading.Thread(target=dev_layer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# ---- references and the build --------------------------------------------------------------------

def test_references_match_numpy():
    rng = np.random.default_rng(130)
    x, w = rand(rng, (3, 72), BF16), rand(rng, (40, 72), BF16, 0.2)
    ref, _ = ref_linear(x, w)
    y = native.linear_reference(jnp.asarray(x), jnp.asarray(w))
    assert y.dtype == jnp.bfloat16
    assert_close(y, rbf(ref), np.abs(ref), 2.0 ** -7)
    gate_up, down = rand(rng, (80, 72), BF16, 0.2), rand(rng, (72, 40), BF16, 0.2)
    ref, scale = ref_expert(x, gate_up[:40], gate_up[40:], down, low=True)
    assert_close(native.swiglu_reference(jnp.asarray(x), jnp.asarray(gate_up), jnp.asarray(down)), ref, scale,
                 2.0 ** -7)


def test_build_without_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MOESCOPE_NATIVE_DIR", str(tmp_path))
    with pytest.raises(build.BuildError, match="no C\\+\\+ compiler"):
        build.build()


def test_unavailable_library_falls_back(tmp_path):
    """Without a compiler: one warning naming the cause, and the JAX wrappers still compute (pure XLA)."""
    code = (
        "import warnings, numpy as np, jax, jax.numpy as jnp\n"
        "from models import native\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    assert not native.available() and not native.available()\n"
        "    x, gu = jnp.ones((2, 8), jnp.bfloat16), jnp.ones((6, 8), jnp.bfloat16)\n"
        "    d = jnp.ones((8, 3), jnp.bfloat16)\n"
        "    y = jax.jit(native.swiglu)(x, gu, d)\n"
        "    assert y.shape == (2, 8) and float(y[0, 0]) > 0\n"
        "msgs = [str(m.message) for m in w if 'models.native' in str(m.message)]\n"
        "assert len(msgs) == 1 and 'no C++ compiler' in msgs[0], msgs\n"
        "print('ok')\n"
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), MOESCOPE_NATIVE_DIR=str(tmp_path),
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


# ---- take_rows (embedding lookup) ------------------------------------------------------------------

def np_take(table: np.ndarray, index: np.ndarray) -> np.ndarray:
    """numpy rows with take_rows' index rule: negative counts from the end, then clamp into [0, V-1]."""
    V = table.shape[0]
    i = np.asarray(index, np.int64)
    i = np.where(i < 0, i + V, i)
    return table[np.clip(i, 0, V - 1)]


@needs_native
@pytest.mark.parametrize("dtype", [BF16, np.float32, np.float16, np.int16, np.uint8], ids=str)
def test_take_rows_matches_numpy(dtype):
    rng = np.random.default_rng(200)
    V, H = 37, 24
    table = (rng.standard_normal((V, H)) * 50).astype(dtype)
    f = jax.jit(native.take_rows)
    for index in (np.array([3], np.int32), np.array([[0, 36, 5], [5, 5, 1]], np.int32), np.zeros((0,), np.int32),
                  np.array([-1, -37, -38, 37, 1000, -(2 ** 31)], np.int32), np.int32(7)):
        y = f(jnp.asarray(table), jnp.asarray(index))
        assert y.dtype == table.dtype and y.shape == np.shape(index) + (H,)
        assert np.asarray(y).tobytes() == np_take(table, index).tobytes()
        assert np.asarray(y).tobytes() == np.asarray(native.take_rows_reference(jnp.asarray(table),
                                                                               jnp.asarray(index))).tobytes()
    assert "moescope_take_rows" in f.lower(jnp.asarray(table), jnp.asarray(index)).as_text()
    # a table with more dims, and an int16 index
    t3 = (rng.standard_normal((V, 3, 5)) * 9).astype(dtype)
    idx = np.array([[2, -1], [40, 0]], np.int16)
    y = f(jnp.asarray(t3), jnp.asarray(idx))
    assert y.shape == (2, 2, 3, 5) and np.asarray(y).tobytes() == np_take(t3, idx).tobytes()


@needs_native
def test_take_rows_large_threads_and_grad(threads_default):
    rng = np.random.default_rng(210)
    V, H, N = 3000, 1024, 2500  # 5 MiB of rows: copied over threads
    table = rand(rng, (V, H), BF16)
    index = rng.integers(-V, 2 * V, N).astype(np.int32)
    want = np_take(table, index)
    for n in (1, 2):
        native.set_threads(n)
        assert np.asarray(jax.jit(native.take_rows)(jnp.asarray(table), jnp.asarray(index))).tobytes() == want.tobytes()
    small = jnp.asarray(table[:50, :8])
    idx = jnp.asarray([[1, 2], [2, 49]], jnp.int32)
    loss = lambda t, take: (take(t, idx).astype(jnp.float32) * jnp.arange(8.0)).sum()  # noqa: E731
    got = jax.grad(lambda t: loss(t, native.take_rows))(small)
    assert np.array_equal(np.asarray(got), np.asarray(jax.grad(lambda t: loss(t, native.take_rows_reference))(small)))
    batched = jax.vmap(native.take_rows, in_axes=(None, 0))(small, idx)
    assert np.asarray(batched).tobytes() == np_take(np.asarray(small), np.asarray(idx)).tobytes()


def _take_loop(take):
    def program(table, idx):
        def body(c):
            i, acc = c
            return i + 1, acc + take(table, (idx + 7 * i) % table.shape[0]).astype(jnp.float32)
        return jax.lax.while_loop(lambda c: c[0] < 4, body, (0, jnp.zeros(idx.shape + table.shape[1:], jnp.float32)))[1]
    return jax.jit(program)


@needs_native
def test_take_rows_in_while_loop():
    rng = np.random.default_rng(220)
    table = rand(rng, (101, 40), BF16)
    idx = rng.integers(0, 101, (3, 5)).astype(np.int32)
    got = _take_loop(native.take_rows)(jnp.asarray(table), jnp.asarray(idx))
    want = sum(np_take(table, (idx + 7 * i) % 101).astype(np.float32) for i in range(4))
    assert np.array_equal(np.asarray(got), want)


def table_sized_copies(hlo: str, V: int, H: int) -> list[str]:
    """Instructions of compiled HLO text that produce an array of V * H elements other than by a parameter, a
    tuple element or a bitcast (views): a convert, copy, bitcast-convert or fusion materialising the table."""
    import re

    bad = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%\S+\s*=\s*\w+\[([\d,]*)\](?:\{[^}]*\})?\s+([\w-]+)\(", line)
        if m and m.group(1) and np.prod([int(d) for d in m.group(1).split(",")]) == V * H:
            if m.group(2) not in ("parameter", "get-tuple-element", "bitcast"):
                bad.append(line.strip()[:200])
    return bad


@needs_native
def test_take_rows_no_table_copy_in_compiled_hlo():
    """Gathering from a bf16 table argument in a while_loop: no [V, H]-sized convert / copy in the compiled program
    (XLA:CPU's own bf16 gather converts the whole table and keeps the copy alive across the loop)."""
    V, H = 1031, 96
    table, idx = jnp.zeros((V, H), jnp.bfloat16), jnp.arange(6, dtype=jnp.int32)
    hlo = _take_loop(native.take_rows).lower(table, idx).compile().as_text()
    assert "moescope_take_rows" in hlo
    assert table_sized_copies(hlo, V, H) == []
    # the check does see a materialised table (an explicit whole-table convert before the gather)
    hlo = _take_loop(lambda t, i: t.astype(jnp.float32)[i]).lower(table, idx).compile().as_text()
    assert table_sized_copies(hlo, V, H)


# ---- experts: a layer's routed experts in one FFI call ------------------------------------------------

STRATEGIES = ("auto", "rows", "experts")


def layer_routing(rng, T, E, k, empty=(), pad=0):
    """Top-k routing of T tokens over E experts (the experts in `empty` get no pair) as the FFI takes it:
    tokens int32 [P + pad] sorted by expert, weights f32, offsets int32 [E + 1]; the `pad` pairs past
    offsets[E] hold garbage (tokens out of range, NaN / inf weights) that must be ignored."""
    allowed = [e for e in range(E) if e not in empty]
    choices = [rng.choice(allowed, size=k, replace=False) for _ in range(T)]
    pairs = sorted((int(e), t) for t, es in enumerate(choices) for e in es)
    offsets = np.searchsorted([e for e, _ in pairs], np.arange(E + 1)).astype(np.int32)
    tokens = np.array([t for _, t in pairs] + list(rng.choice([-3, T, T + 999, 2 ** 31 - 1], pad)), np.int32)
    weights = np.concatenate([rng.uniform(0.1, 1.0, len(pairs)), rng.choice([np.nan, np.inf, -1e30], pad)])
    return tokens, weights.astype(np.float32), offsets


def gate_up_down(gates, ups, downs):
    return [np.concatenate([g, u]) for g, u in zip(gates, ups)], list(downs)


def run_experts(x, tokens, weights, offsets, gu, dn, strategy="auto", fn=None):
    fn = fn or jax.jit(lambda *a: native.experts(*a[:4], a[4], a[5], strategy=strategy))
    return np.asarray(fn(jnp.asarray(x), jnp.asarray(tokens), jnp.asarray(weights), jnp.asarray(offsets),
                         [jnp.asarray(a) for a in gu], [jnp.asarray(a) for a in dn]))


@needs_native
@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("E,T,k,empty", [(1, 1, 1, ()), (3, 17, 2, ()), (8, 300, 8, ()),
                                         (64, 40, 6, (0, 5, 6, 7, 33, 63))], ids=["E1", "E3", "E8-T300", "E64"])
def test_experts_ffi(isa, dtype, E, T, k, empty, threads_default):
    rng = np.random.default_rng(300 + E + T)
    H, F = 48, 24
    gates, ups, downs = expert_weights(rng, E, H, F, dtype)
    gu, dn = gate_up_down(gates, ups, downs)
    x = rand(rng, (T, H), dtype)
    tokens, weights, offsets = layer_routing(rng, T, E, k, empty, pad=5)
    assert all(offsets[e] == offsets[e + 1] for e in empty)
    low = dtype is BF16
    P = int(offsets[-1])
    ref, scale = ref_experts(np.zeros((T, H), np.float32), x, gates, ups, downs, offsets, tokens[:P], weights[:P],
                             low)
    outs = {}
    for threads in (1, 2):
        native.set_threads(threads)
        for st in STRATEGIES:
            outs[threads, st] = run_experts(x, tokens, weights, offsets, gu, dn, st)
    y = outs[1, "auto"]
    assert y.dtype == np.float32 and y.shape == (T, H)
    assert all(np.array_equal(y, o) for o in outs.values())  # threads and strategies: bit for bit
    assert_close(y, ref, scale, 2.0 ** -7 if low else 1e-5)
    xla = jax.jit(native.experts_reference)(jnp.asarray(x), jnp.asarray(tokens), jnp.asarray(weights),
                                            jnp.asarray(offsets), [jnp.asarray(a) for a in gu],
                                            [jnp.asarray(a) for a in dn])
    assert_close(xla, ref, scale, 2.0 ** -7 if low else 1e-5)
    # the host path computes the same numbers
    out = np.zeros((T, H), np.float32)
    native.experts_host(out, x, gates, ups, downs, offsets.astype(np.int64), tokens, weights, threads=2)
    assert np.array_equal(out, y)


@needs_native
@pytest.mark.parametrize("m", [1, 3])
def test_experts_strategies_and_threads_identical_large(m, threads_default):
    """Experts over 256 KiB a phase (the row split really splits rows over threads), a token routed to several
    experts, 1..3 threads, every strategy, FFI and host: the same bits."""
    rng = np.random.default_rng(310 + m)
    T, H, F, E = 8, 256, 520, 7
    gates, ups, downs = expert_weights(rng, E, H, F, BF16, 0.1)
    gu, dn = gate_up_down(gates, ups, downs)
    x = rand(rng, (T, H), BF16)
    # experts 0, 2, 3 get m rows, expert 5 gets 2 rows (token 7 in three experts), expert 6 many: uneven costs
    rows = {0: list(range(m)), 2: [7, 1, 2][:m], 3: [7] + list(range(3, 2 + m)), 5: [4, 7], 6: [0, 1, 2, 3, 4, 5, 6, 7]}
    tokens = np.array([t for e in range(E) for t in rows.get(e, [])] + [99, -1], np.int32)
    offsets = np.array([0] + list(np.cumsum([len(rows.get(e, [])) for e in range(E)])), np.int32)
    weights = np.concatenate([rng.uniform(0.1, 1, len(tokens) - 2), [np.nan, np.nan]]).astype(np.float32)
    outs = []
    for threads in (1, 2, 3):
        native.set_threads(threads)
        for st in STRATEGIES:
            outs.append(run_experts(x, tokens, weights, offsets, gu, dn, st))
            out = np.zeros((T, H), np.float32)
            native.experts_host(out, x, gates, ups, downs, offsets.astype(np.int64), tokens, weights,
                                threads=threads, strategy=st)
            outs.append(out)
        # subsets of the experts: 2 and 3 used experts (whole rounds and a leftover for 2 threads)
        for used in ((0, 2), (0, 2, 3), (2, 3, 5)):
            sub = np.array([t for e in used for t in rows[e]], np.int32)
            offs = np.array([0] + list(np.cumsum([len(rows[e]) if e in used else 0 for e in range(E)])), np.int64)
            got = []
            for st in STRATEGIES:
                out = np.zeros((T, H), np.float32)
                w = weights[:len(sub)].copy()
                native.experts_host(out, x, gates, ups, downs, offs, sub, w, threads=threads, strategy=st)
                got.append(out)
            assert all(np.array_equal(got[0], g) for g in got[1:]), (threads, used)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    ref, scale = ref_experts(np.zeros((T, H), np.float32), x, gates, ups, downs, offsets, tokens, weights, True)
    assert_close(outs[0], ref, scale, 2.0 ** -7)


@needs_native
def test_experts_control_flow_and_stacked(isa):
    rng = np.random.default_rng(320)
    T, H, F, E = 5, 40, 24, 4
    gates, ups, downs = expert_weights(rng, E, H, F, BF16)
    gu, dn = gate_up_down(gates, ups, downs)
    gu_j, dn_j = [jnp.asarray(a) for a in gu], [jnp.asarray(a) for a in dn]
    x = jnp.asarray(rand(rng, (T, H), BF16))
    tokens, weights, offsets = (jnp.asarray(a) for a in layer_routing(rng, T, E, 2, (1,), pad=3))
    want = np.asarray(jax.jit(native.experts)(x, tokens, weights, offsets, gu_j, dn_j))
    stacked = jax.jit(native.experts)(x, tokens, weights, offsets, jnp.stack(gu_j), jnp.stack(dn_j))
    assert np.array_equal(np.asarray(stacked), want)

    @jax.jit
    def program(i, x, gu, dn):
        layer = lambda h: native.experts(h, tokens, weights, offsets, gu, dn)  # noqa: E731

        def body(c):
            j, h, acc = c
            y = layer(h)
            return j + 1, (y * 0.5).astype(h.dtype), acc + y
        n, h, acc = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x, jnp.zeros(x.shape, jnp.float32)))
        c = jax.lax.cond(i == 0, layer, lambda h: h.astype(jnp.float32), x)
        s = jax.lax.switch(i, [lambda h: h.astype(jnp.float32), layer], x)
        return acc, c, s

    acc, c, s = program(0, x, gu_j, dn_j)
    hlo = program.lower(0, x, gu_j, dn_j).compile().as_text()  # the weights reach the calls uncopied
    assert hlo.count("moescope_experts") >= 3
    assert table_sized_copies(hlo, 2 * F, H) == [] and table_sized_copies(hlo, H, F) == []
    h, want_acc = x, np.zeros((T, H), np.float32)
    for _ in range(3):
        y = np.asarray(jax.jit(native.experts)(h, tokens, weights, offsets, gu_j, dn_j))
        want_acc += y
        h = jnp.asarray((y * 0.5).astype(BF16))
    assert np.array_equal(np.asarray(acc), want_acc)
    assert np.array_equal(np.asarray(c), want)
    assert np.array_equal(np.asarray(program(1, x, gu_j, dn_j)[2]), want)
    assert np.array_equal(np.asarray(s), np.asarray(x, np.float32))


@needs_native
def test_experts_edge_cases():
    rng = np.random.default_rng(330)
    H, F, E = 16, 8, 3
    gates, ups, downs = expert_weights(rng, E, H, F, np.float32)
    gu, dn = gate_up_down(gates, ups, downs)
    x = rand(rng, (4, H), np.float32)
    # no token, no pair, only padding, no expert
    for T, tokens, offsets in ((0, [], [0, 0, 0, 0]), (4, [], [0, 0, 0, 0]), (4, [9, -9], [0, 0, 0, 0]),
                               (4, [1, 9], [0, 0, 1, 1])):
        tokens, offsets = np.array(tokens, np.int32), np.array(offsets, np.int32)
        weights = np.full(len(tokens), np.nan, np.float32)
        weights[:offsets[-1]] = 1.0
        y = run_experts(x[:T], tokens, weights, offsets, gu, dn)
        want = np.zeros((T, H), np.float32)
        if offsets[-1]:
            want[1] = ref_expert(x[1:2], gates[1], ups[1], downs[1], False)[0][0]
        assert y.shape == (T, H)
        assert_close(y, want, np.abs(want) + 1, 1e-5)
    y = run_experts(x, np.zeros(2, np.int32), np.ones(2, np.float32), np.zeros(1, np.int32), [], [])
    assert np.array_equal(y, np.zeros((4, H), np.float32))
    # pairs before offsets[0] are ignored too
    y = run_experts(x, np.array([-5, 2, 3], np.int32), np.array([np.nan, 1, 1], np.float32),
                    np.array([1, 2, 2, 3], np.int32), gu, dn)
    want = np.zeros((4, H))
    want[2] = ref_expert(x[2:3], gates[0], ups[0], downs[0], False)[0][0]
    want[3] = ref_expert(x[3:4], gates[2], ups[2], downs[2], False)[0][0]
    assert_close(y, want, np.abs(want) + 1, 1e-5)


@needs_native
def test_experts_rejects_bad_arguments():
    rng = np.random.default_rng(340)
    H, F, E, T = 16, 8, 2, 3
    gates, ups, downs = expert_weights(rng, E, H, F, BF16)
    gu, dn = gate_up_down(gates, ups, downs)
    x = rand(rng, (T, H), BF16)
    tokens, weights, offsets = np.array([0, 1, 2], np.int32), np.ones(3, np.float32), np.array([0, 1, 3], np.int32)
    run_experts(x, tokens, weights, offsets, gu, dn)
    with pytest.raises(ValueError, match="expected E gate_up"):
        run_experts(x, tokens, weights, offsets, gu[:1], dn)
    with pytest.raises(ValueError, match="dtype"):
        run_experts(x, tokens, weights, offsets, [g.astype(np.float32) for g in gu], dn)
    with pytest.raises(ValueError, match="strategy"):
        run_experts(x, tokens, weights, offsets, gu, dn, strategy="fast")
    with pytest.raises(Exception, match="outside"):  # a live pair's token out of range: a run-time error
        run_experts(x, np.array([0, 1, 3], np.int32), weights, offsets, gu, dn)
    with pytest.raises(Exception, match="offsets"):
        run_experts(x, tokens, weights, np.array([0, 2, 1], np.int32), gu, dn)
    with pytest.raises(Exception, match="offsets"):
        run_experts(x, tokens, weights, np.array([0, 1, 4], np.int32), gu, dn)


def test_experts_reference_matches_numpy():
    rng = np.random.default_rng(350)
    T, H, F, E = 6, 24, 16, 5
    gates, ups, downs = expert_weights(rng, E, H, F, BF16)
    gu, dn = gate_up_down(gates, ups, downs)
    x = rand(rng, (T, H), BF16)
    tokens, weights, offsets = layer_routing(rng, T, E, 3, (2,), pad=4)
    P = int(offsets[-1])
    ref, scale = ref_experts(np.zeros((T, H), np.float32), x, gates, ups, downs, offsets, tokens[:P], weights[:P], True)
    for g, d in ((gu, dn), (np.stack(gu), np.stack(dn))):
        y = native.experts_reference(jnp.asarray(x), tokens, weights, offsets, g, d)
        assert y.dtype == jnp.float32
        assert_close(y, ref, scale, 2.0 ** -7)


@needs_native
def test_experts_never_touch_unused_experts(tmp_path):
    """The weights of experts without pairs sit in pages that may not be read at all (PROT_NONE): a read would
    kill the process (run in a child)."""
    code = (
        "import ctypes, mmap, numpy as np, ml_dtypes\n"
        "from models import native\n"
        "BF = ml_dtypes.bfloat16\n"
        "H, F, T = 64, 32, 4\n"
        "rng = np.random.default_rng(0)\n"
        "ok = lambda *s: (rng.standard_normal(s) * 0.1).astype(BF)\n"
        "n = (2 * F * H + H * F) * 2\n"
        "region = mmap.mmap(-1, n)\n"
        "forbidden = np.frombuffer(region, dtype=BF)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\n"
        "assert libc.mprotect(forbidden.ctypes.data, n, 0) == 0  # PROT_NONE\n"
        "fg, fu, fd = (forbidden[:F * H].reshape(F, H), forbidden[F * H:2 * F * H].reshape(F, H),\n"
        "              forbidden[2 * F * H:].reshape(H, F))\n"
        "gates = [ok(F, H), fg, ok(F, H), fg, ok(F, H)]\n"
        "ups = [ok(F, H), fu, ok(F, H), fu, ok(F, H)]\n"
        "downs = [ok(H, F), fd, ok(H, F), fd, ok(H, F)]\n"
        "x = ok(T, H)\n"
        "offsets = np.array([0, 2, 2, 4, 4, 5], np.int64)\n"
        "tokens, w = np.array([0, 1, 1, 3, 2], np.int32), np.ones(5, np.float32)\n"
        "for threads in (1, 2):\n"
        "    for st in ('auto', 'rows', 'experts'):\n"
        "        out = np.zeros((T, H), np.float32)\n"
        "        native.experts_host(out, x, gates, ups, downs, offsets, tokens, w, threads=threads, strategy=st)\n"
        "        assert np.isfinite(out).all() and np.abs(out).sum() > 0\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, (done.returncode, done.stderr[-2000:])


@needs_native
def test_ffi_on_own_threads_same_bits(tmp_path):
    """FFI calls borrow XLA's intra-op pool for their helpers; on the library's own pool (MOESCOPE_NATIVE_XLA_POOL=0,
    a child process) the experts and swiglu FFI give the same bits."""
    code = (
        "import sys, numpy as np, jax, jax.numpy as jnp, ml_dtypes\n"
        "from models import native\n"
        "rng = np.random.default_rng(400)\n"
        "BF = ml_dtypes.bfloat16\n"
        "T, H, F, E = 6, 256, 520, 5\n"
        "x = jnp.asarray((rng.standard_normal((T, H))).astype(BF))\n"
        "gu = [jnp.asarray((rng.standard_normal((2 * F, H)) * 0.1).astype(BF)) for _ in range(E)]\n"
        "dn = [jnp.asarray((rng.standard_normal((H, F)) * 0.1).astype(BF)) for _ in range(E)]\n"
        "tokens = jnp.asarray([0, 1, 2, 2, 3, 5, 0, 4, 5], jnp.int32)\n"
        "offsets = jnp.asarray([0, 2, 2, 5, 7, 9], jnp.int32)\n"
        "w = jnp.linspace(0.2, 1.0, 9, dtype=jnp.float32)\n"
        "native.set_threads(2)\n"
        "outs = [jax.jit(lambda *a, s=s: native.experts(*a, strategy=s))(x, tokens, w, offsets, gu, dn)\n"
        "        for s in ('rows', 'experts')]\n"
        "outs.append(jax.jit(native.swiglu)(x, gu[0], dn[0]))\n"
        "np.save(sys.argv[1], np.stack([np.asarray(o) for o in outs]))\n"
    )
    results = []
    for flag in ("1", "0"):
        path = tmp_path / f"out{flag}.npy"
        env = dict(os.environ, JAX_PLATFORMS="cpu", MOESCOPE_NATIVE_XLA_POOL=flag)
        done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        results.append(np.load(path))
    assert np.array_equal(results[0], results[1])
    assert np.array_equal(results[0][0], results[0][1])
