"""moescope's compiled CPU kernels for bf16 (and f32) and block-quantized weights: dots and SwiGLU experts.

Block-quantized weights (ggml's Q8_0, Q4_0, Q4_K, Q6_K blocks byte for byte, as `models.quant.blocks.QuantArray`)
go through the same entry points: `linear(x, w)`, `swiglu(x, gate_up, down)` and `experts(...)` in JAX
(`qlinear`, `qswiglu`, `qexperts`), `linear_host`, `pack_experts` and `experts_host` on the host; activations
are quantized as llama.cpp does (Q8_0 per 32 for Q8_0 / Q4_0, Q8_K per 256 for Q4_K / Q6_K), integer dot
products (VNNI VPDPBUSD, AVX2 VPMADDWD, scalar), scales applied per group; on the "amx" path, calls of enough rows
(>= 12 rows, every block type) instead dequantize the weights to bf16 and run AMX-BF16 tiles on bf16
activations (`block_rounding` says which, `rounded_operands` gives the rounded operands); references:
`qlinear_reference` (numpy, gguf's dequantizer, either rounding), `qlinear_jax_reference` (XLA, Q8).

XLA:CPU converts a whole bf16 weight to f32 on every bf16 dot (a matvec runs far below the memory
read rate), and torch's bf16 linear also stays well below it; these kernels stream bf16 weights at close
to the memory read rate (AVX512-BF16 dot products, AVX2+FMA or scalar fallbacks chosen at load time). Two ways in:

* JAX, inside `jax.jit` / `lax.cond` / `lax.switch` / `lax.while_loop`: `linear(x, w)` and
  `swiglu(x, gate_up, down)`, XLA FFI custom calls on the CPU backend and XLA's own dot_general on any
  other backend (`lax.platform_dependent`), or everywhere when the library is unavailable
  (`linear_reference`, `swiglu_reference`: the same math in pure XLA). `take_rows(table, index)`: an
  embedding lookup that copies just the rows (XLA:CPU converts or copies a whole bf16 table to gather
  from it), the same way. `experts(x, tokens, pair_weight, offsets, gate_up, down)`: all the routed experts
  of an MoE layer in one call over their live (token, expert) pairs -- a raw CPU-only custom call (check
  `available_experts()`, wrap it in `lax.platform_dependent` with an XLA path such as `experts_reference`).
* Host code (numpy / torch arrays, ctypes; the GIL is released while the kernels run):
  `experts_host` runs all the CPU experts of a layer in one call, `linear_host` one linear map.

Weights are [out, in] (HF/torch layout): a linear map W [N, K] gives y[m, n] = sum_k x[m, k] W[n, k];
an expert is gate [F, H], up [F, H], down [H, F] (in JAX, gate and up stacked as gate_up [2F, H]).

Numerics: f32 accumulation always. bf16 weights take bf16 activations; a SwiGLU expert rounds the gate
and up projections to bf16, computes silu(g) * u in f32, rounds h to bf16, and returns the down
projection in f32 (unrounded); `linear` rounds its f32 sums once to bf16. f32 weights: plain f32.
Results do not depend on the thread count (the f32 summation order depends only on K, the ISA path and,
with AVX-512, on whether a call has one activation row or more).

The library is compiled on first use (`models/native/build.py`, 5-10 s with g++ 12) and cached.
Without a compiler every entry point still works (pure XLA in JAX; `experts_host` and `linear_host`
raise, check `available()` first); `load()` warns once, naming the cause.

Environment: `MOESCOPE_NATIVE_DISABLE=1` skips the library; `MOESCOPE_NATIVE_ISA=amx|avx512bf16|avx2|scalar`
chooses a path (also `set_isa`); "amx" -- AMX-BF16 tiles for calls of >= 16 rows (block types: >= 12, see above), AVX-512
below that, where the CPU has it and the kernel grants the tile state -- is the default where present (see `default_isa`); `MOESCOPE_NATIVE_DIR` chooses the build folder; `CXX` the compiler;
`MOESCOPE_NATIVE_QPREFETCH=l1|l2|off` the cache level the AVX-512 block kernels prefetch weights into (default: L1
on AMD, L2 elsewhere; also `set_qprefetch`); `MOESCOPE_NATIVE_EP_MAX_MB` (default 64) the largest expert (MiB of weights) a layer call shares out whole
to a thread; `MOESCOPE_NATIVE_XLA_POOL=0` keeps FFI calls on the library's own threads instead of
borrowing XLA's intra-op pool.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

__all__ = [
    "load", "available", "build_error", "isa", "best_isa", "set_isa", "qprefetch", "set_qprefetch", "set_threads", "get_threads",
    "linear", "swiglu", "linear_reference", "swiglu_reference", "take_rows", "take_rows_reference",
    "experts", "experts_reference", "available_experts",
    "ExpertWeights", "pack_experts", "experts_host", "linear_host", "stream_read", "count_nonfinite", "native_or",
    "QTYPE_IDS", "quantize_activations", "dequantize", "block_rounding", "set_amx_rows", "rounded_operands",
    "qlinear_reference", "qswiglu_reference", "qexperts_host_reference",
    "dequantize_jax", "qlinear_jax_reference", "qlinear", "qswiglu", "qexperts", "qexperts_reference", "random_blocks",
]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)
_W_BF16, _W_F32 = 0, 1

# FFI target name -> exported handler symbol
_TARGETS = {
    "moescope_linear": "ms_ffi_linear_bf16",
    "moescope_linear_f32": "ms_ffi_linear_f32",
    "moescope_swiglu": "ms_ffi_swiglu_bf16",
    "moescope_swiglu_f32": "ms_ffi_swiglu_f32",
    "moescope_take_rows": "ms_ffi_take_rows",
    "moescope_experts": "ms_ffi_experts_bf16",
    "moescope_experts_f32": "ms_ffi_experts_f32",
    "moescope_qlinear": "ms_ffi_qlinear",
    "moescope_qswiglu": "ms_ffi_qswiglu",
    "moescope_qexperts": "ms_ffi_qexperts",
}
_STRATEGIES = {"auto": 0, "rows": 1, "experts": 2}

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_error: Optional[str] = None
_tried = False
_ffi = False  # FFI targets registered with jax


# ---- loading ---------------------------------------------------------------------------------------

def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    vp, i64, i32 = c.c_void_p, c.c_int64, c.c_int
    lib.ms_isa.restype = c.c_char_p
    lib.ms_isa.argtypes = []
    lib.ms_best_isa.restype = c.c_char_p
    lib.ms_best_isa.argtypes = []
    lib.ms_last_error.restype = c.c_char_p
    lib.ms_last_error.argtypes = []
    lib.ms_set_isa.restype = i32
    lib.ms_set_isa.argtypes = [c.c_char_p]
    lib.ms_set_threads.restype = None
    lib.ms_set_threads.argtypes = [i32]
    lib.ms_get_threads.restype = i32
    lib.ms_get_threads.argtypes = []
    lib.ms_has_ffi.restype = i32
    lib.ms_has_ffi.argtypes = []
    lib.ms_linear.restype = i32
    lib.ms_linear.argtypes = [vp, i64, i64, vp, i64, vp, i32, i32]
    lib.ms_experts.restype = i32
    lib.ms_experts.argtypes = [vp, i64, i64, i64, i32, i64, vp, vp, vp, vp, i64, vp, vp, vp, i32, vp, i32]
    lib.ms_qlinear.restype = i32
    lib.ms_qlinear.argtypes = [vp, i32, i64, i64, vp, i32, i64, vp, i32]
    lib.ms_qquantize.restype = i32
    lib.ms_qquantize.argtypes = [vp, i64, i64, i32, vp, vp]
    if hasattr(lib, "ms_qrow_bytes"):  # (A/B benches declare older builds too, which lack it)
        lib.ms_qrow_bytes.restype = i64
        lib.ms_qrow_bytes.argtypes = [i32, i64]
        lib.ms_qquantize_rows.restype = i32
        lib.ms_qquantize_rows.argtypes = [vp, i64, i64, i32, vp]
    if hasattr(lib, "ms_set_qprefetch"):  # (as above)
        lib.ms_set_qprefetch.restype = i32
        lib.ms_set_qprefetch.argtypes = [c.c_char_p]
        lib.ms_qprefetch.restype = c.c_char_p
        lib.ms_qprefetch.argtypes = []
    if hasattr(lib, "ms_silu_mul"):  # (as above)
        lib.ms_silu_mul.restype = None
        lib.ms_silu_mul.argtypes = [vp, vp, vp, i64, i32]
    lib.ms_qpath.restype = i32
    lib.ms_qpath.argtypes = [i32, i64]
    lib.ms_set_amx_rows.restype = i32
    lib.ms_set_amx_rows.argtypes = [i32, i32]
    lib.ms_qexperts.restype = i32
    lib.ms_qexperts.argtypes = [vp, i32, i64, i64, i64, i32, i32, i32, i64, vp, vp, vp, vp, i64, vp, vp, vp, i32, vp, i32]
    lib.ms_read.restype = c.c_double
    lib.ms_read.argtypes = [vp, i64, i32]
    lib.ms_nonfinite.restype = i64
    lib.ms_nonfinite.argtypes = [vp, i64, i32, i32, i32]


def load() -> Optional[ctypes.CDLL]:
    """The native library (built if needed, once per process; FFI targets registered with jax), or None
    when it cannot be had: then a one-line warning names the cause, once, and `build_error()` returns it."""
    global _lib, _error, _tried, _ffi
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get("MOESCOPE_NATIVE_DISABLE", "") not in ("", "0"):
                raise RuntimeError("disabled by MOESCOPE_NATIVE_DISABLE")
            from models.native import build as _build

            path, _ = _build.build()
            lib = ctypes.CDLL(str(path))
            _declare(lib)
            lib.ms_set_isa(_default_isa(lib).encode())
            if lib.ms_has_ffi():
                for name, symbol in _TARGETS.items():
                    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _ffi = True
            _lib = lib
        except Exception as e:  # noqa: BLE001 - any failure means "no native kernels", said once
            _error = " ".join(f"{e.__class__.__name__}: {e}".split())
            warnings.warn(f"models.native: compiled CPU kernels unavailable ({_error}); "
                          f"using XLA / torch instead", RuntimeWarning, stacklevel=2)
        _tried = True
    return _lib


def available() -> bool:
    """Whether the native library loaded (builds it on first call)."""
    return load() is not None


def build_error() -> Optional[str]:
    """Why the library is unavailable (None if it loaded or was not tried yet)."""
    return _error


def _need() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"models.native: library unavailable ({_error})")
    return lib


def isa() -> str:
    """The ISA path in use: "amx", "avx512bf16" (with VNNI), "avx2" or "scalar" ("none" without the library)."""
    lib = load()
    return lib.ms_isa().decode() if lib is not None else "none"


def best_isa() -> str:
    """The fastest ISA path this CPU supports ("none" without the library)."""
    lib = load()
    return lib.ms_best_isa().decode() if lib is not None else "none"


def _default_isa(lib: ctypes.CDLL) -> str:
    """`MOESCOPE_NATIVE_ISA` when set, else the best path this CPU has (AMX where present: its tiles take calls of
    >= 16 rows, AVX-512 the smaller ones; the offloaded run stays inside bf16's envelope of the in-memory model at
    real width with it, `tests/test_real_width_serving.py -m slow -k envelope`)."""
    return os.environ.get("MOESCOPE_NATIVE_ISA") or lib.ms_best_isa().decode()


def default_isa() -> str:
    """The path a process starts on (see `_default_isa`); "none" without the library."""
    lib = load()
    return _default_isa(lib) if lib is not None else "none"


def set_isa(name: Optional[str]) -> None:
    """Force an ISA path ("amx", "avx512bf16", "avx2", "scalar"; None: `default_isa()`). ValueError if the CPU
    lacks it. Process-wide; meant for tests and benchmarks."""
    lib = _need()
    if lib.ms_set_isa((name or _default_isa(lib)).encode()) != 0:
        raise ValueError(lib.ms_last_error().decode())


def qprefetch() -> str:
    """Where the AVX-512 block kernels prefetch their weight streams: "l1", "l2" or "off" ("none" without the
    library)."""
    lib = load()
    return lib.ms_qprefetch().decode() if lib is not None else "none"


def set_qprefetch(level: Optional[str]) -> None:
    """Prefetch the block kernels' weight streams into "l1", "l2" or not at all ("off"); None: the level a process
    starts at, `MOESCOPE_NATIVE_QPREFETCH` when set, else this CPU's default (L1 on AMD, L2 elsewhere: the faster
    level where each was measured, `kQPrefetch` in kernels.cc). Changes speed, never a result. Process-wide; meant
    for benchmarks. ValueError for another name."""
    lib = _need()
    if lib.ms_set_qprefetch((level or os.environ.get("MOESCOPE_NATIVE_QPREFETCH") or "").encode()) != 0:
        raise ValueError(lib.ms_last_error().decode())


def set_threads(n: int) -> None:
    """Threads of the FFI kernels (and of host calls passing threads=0); n <= 0: the CPUs this process may use
    (the default). An FFI call's helpers are tasks on XLA's intra-op pool, so it also uses at most one thread
    more than that pool has. Without the library this does nothing."""
    lib = load()
    if lib is not None:
        lib.ms_set_threads(int(n))


def get_threads() -> int:
    """The current default thread count (0 without the library)."""
    lib = load()
    return int(lib.ms_get_threads()) if lib is not None else 0


# ---- JAX wrappers --------------------------------------------------------------------------------

def _dot_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] . w [N, K]^T -> [..., N], accumulated in f32 (f32 inputs at full precision on any backend)."""
    return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _both(a: Any, b: Any, dtype: Any) -> bool:
    return a.dtype == dtype and b.dtype == dtype


def linear_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """Pure-XLA `linear`: x [..., K] times w [N, K]^T -> [..., N], f32 accumulation, result rounded once
    to bf16 when both are bf16 (else in their common dtype)."""
    out = jnp.bfloat16 if _both(x, w, jnp.bfloat16) else jnp.result_type(x.dtype, w.dtype)
    return _dot_t(x, w).astype(out)


def swiglu_reference(x: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """Pure-XLA `swiglu`: x [..., H], gate_up [2F, H] (gate rows first), down [H, F] -> f32 [..., H].
    With bf16 weights and activation, g and u are rounded to bf16, h = silu(g) * u is computed in f32
    and rounded to bf16, and the down projection is returned in f32."""
    f = gate_up.shape[0] // 2
    low = _both(x, gate_up, jnp.bfloat16) and down.dtype == jnp.bfloat16
    gu = _dot_t(x, gate_up)
    g, u = gu[..., :f], gu[..., f:]
    if low:
        g = g.astype(jnp.bfloat16).astype(jnp.float32)
        u = u.astype(jnp.bfloat16).astype(jnp.float32)
    h = jax.nn.silu(g) * u
    h = h.astype(jnp.bfloat16) if low else h.astype(jnp.result_type(h.dtype, down.dtype))
    return _dot_t(h, down).astype(jnp.float32)


def _ffi_linear(x2: jax.Array, w: jax.Array) -> jax.Array:
    target = "moescope_linear" if x2.dtype == jnp.bfloat16 else "moescope_linear_f32"
    out = jax.ShapeDtypeStruct((x2.shape[0], w.shape[0]), x2.dtype)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x2, w)


def _ffi_swiglu(x2: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    target = "moescope_swiglu" if x2.dtype == jnp.bfloat16 else "moescope_swiglu_f32"
    out = jax.ShapeDtypeStruct((x2.shape[0], down.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x2, gate_up, down)


def native_or(ffi_fn: Callable[..., jax.Array], reference: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """`ffi_fn` on the CPU backend, `reference` elsewhere; differentiated through `reference`'s math."""

    @jax.custom_jvp
    def fn(*args: jax.Array) -> jax.Array:
        return lax.platform_dependent(*args, cpu=ffi_fn, default=reference)

    @fn.defjvp
    def fn_jvp(primals: tuple, tangents: tuple) -> tuple:
        return fn(*primals), jax.jvp(reference, primals, tangents)[1]

    return fn


_linear2 = native_or(_ffi_linear, linear_reference)
_swiglu2 = native_or(_ffi_swiglu, swiglu_reference)


def _native_ok(*arrays: Any) -> bool:
    dt = arrays[0].dtype
    return (dt in (jnp.bfloat16, jnp.float32) and all(a.dtype == dt for a in arrays)
            and all(a.ndim == 2 for a in arrays[1:]) and available_experts())


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] times w [N, K]^T -> [..., N]: bf16 x and w give bf16 (f32 sums rounded once); f32 gives f32.
    On the CPU backend a native FFI kernel; elsewhere, for other dtypes, or without the library,
    `linear_reference`. Usable under jit and control flow; differentiable (through the reference math)."""
    if _is_quant(w):
        return qlinear(x, w)
    if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: x {x.shape} and w {w.shape}: expected x [..., K] and w [N, K]")
    if not _native_ok(x, w):
        return linear_reference(x, w)
    lead = x.shape[:-1]
    y = _linear2(x.reshape(-1, x.shape[-1]), w)
    return y.reshape(*lead, w.shape[0])


def swiglu(x: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """SwiGLU expert: x [..., H], gate_up [2F, H] (gate rows 0..F-1, up rows F..2F-1), down [H, F] -> f32 [..., H].
    All bf16 (roundings as in `swiglu_reference`) or all f32. On the CPU backend a native FFI kernel;
    elsewhere, for other dtypes, or without the library, `swiglu_reference`. Usable under jit and control
    flow; differentiable (through the reference math)."""
    if _is_quant(gate_up) or _is_quant(down):
        return qswiglu(x, gate_up, down)
    h = x.shape[-1] if x.ndim else -1
    if (x.ndim < 1 or gate_up.ndim != 2 or down.ndim != 2 or gate_up.shape[0] % 2 or gate_up.shape[1] != h
            or down.shape != (h, gate_up.shape[0] // 2)):
        raise ValueError(f"swiglu: x {x.shape}, gate_up {gate_up.shape}, down {down.shape}: "
                         f"expected x [..., H], gate_up [2F, H], down [H, F]")
    if not _native_ok(x, gate_up, down):
        return swiglu_reference(x, gate_up, down)
    lead = x.shape[:-1]
    y = _swiglu2(x.reshape(-1, h), gate_up, down)
    return y.reshape(*lead, h)


# ---- row gather (embedding lookup) -----------------------------------------------------------------

_SUB_BYTE = frozenset({"int1", "uint1", "int2", "uint2", "int4", "uint4", "float4_e2m1fn"})


def _take_native_ok(table: Any) -> bool:
    dt = np.dtype(table.dtype)
    return (table.ndim >= 1 and table.shape[0] > 0 and dt.itemsize in (1, 2, 4, 8) and dt.name not in _SUB_BYTE
            and available_experts())


def take_rows_reference(table: jax.Array, index: jax.Array) -> jax.Array:
    """Pure-XLA `take_rows`: `table[index]` (jnp indexing: a negative index counts from the end, and an index
    still outside [0, V) is clamped into it)."""
    return table[index]


def _ffi_take(table: jax.Array, idx: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((idx.shape[0], *table.shape[1:]), table.dtype)
    return jax.ffi.ffi_call("moescope_take_rows", out, vmap_method="sequential")(table, idx)


_take = native_or(_ffi_take, take_rows_reference)


def take_rows(table: jax.Array, index: Any) -> jax.Array:
    """Rows of `table` [V, ...] at integer `index` of any shape [...] -> [..., ...], the same dtype: an
    embedding lookup. XLA:CPU has no bf16 gather (it would convert or copy the WHOLE table on every call,
    or keep a converted copy alive across a while_loop); on the CPU backend this is an FFI custom call that
    memcpys just the N rows (over threads from 4 MiB), for any element type of 1, 2, 4 or 8 bytes (copied as
    raw bits); elsewhere, for other dtypes, or without the library, `table[index]`.
    Index semantics are those of `table[index]`: a negative index counts from the end (index + V), and an
    index still outside [0, V-1] is clamped to it (XLA's gather clamps too), never an error. Usable under
    jit / while_loop / cond / switch; differentiable in `table` (through `table[index]`)."""
    if table.ndim < 1:
        raise ValueError(f"take_rows: table {table.shape}: expected [V, ...]")
    index = jnp.asarray(index)
    if not jnp.issubdtype(index.dtype, jnp.integer):
        raise ValueError(f"take_rows: index dtype {index.dtype}, expected an integer type")
    if not _take_native_ok(table):
        return take_rows_reference(table, index)
    V = table.shape[0]
    flat = index.reshape(-1)
    if flat.dtype != jnp.int32:  # clamp wide indices into [-V, V] first: the same rows, and it fits int32
        if np.iinfo(flat.dtype).max > V:
            unsigned = jnp.issubdtype(flat.dtype, jnp.unsignedinteger)
            flat = jnp.minimum(flat, V) if unsigned else jnp.clip(flat, -V, V)
        flat = flat.astype(jnp.int32)
    rows = _take(table, flat)
    return rows.reshape(*index.shape, *table.shape[1:])


# ---- a layer's routed experts in one call --------------------------------------------------------------

def _strategy(name: str) -> int:
    if name not in _STRATEGIES:
        raise ValueError(f"strategy {name!r}: expected one of {sorted(_STRATEGIES)}")
    return _STRATEGIES[name]


def available_experts() -> bool:
    """Whether `experts` can run here (the library loaded with its XLA FFI targets registered)."""
    return load() is not None and _ffi


def _expert_weights(gate_up: Any, down: Any, E: int, H: int, dtype: Any, what: str) -> tuple[bool, int]:
    """(stacked, F) after checking gate_up / down: E arrays [2F, H] / [H, F], or one [E, 2F, H] / [E, H, F]."""
    stacked = hasattr(gate_up, "ndim") and hasattr(down, "ndim")
    if stacked:
        ok = (gate_up.ndim == 3 and down.ndim == 3 and gate_up.shape[0] == E and down.shape[0] == E
              and gate_up.shape[1] % 2 == 0 and gate_up.shape[2] == H
              and down.shape[1:] == (H, gate_up.shape[1] // 2))
        shapes = f"gate_up {gate_up.shape}, down {down.shape}"
        F = gate_up.shape[1] // 2 if gate_up.ndim == 3 else -1
        dtypes = {gate_up.dtype, down.dtype}
    else:
        gate_up, down = list(gate_up), list(down)
        F = gate_up[0].shape[0] // 2 if gate_up and gate_up[0].ndim == 2 else 0
        ok = (len(gate_up) == E and len(down) == E and all(g.shape == (2 * F, H) for g in gate_up)
              and all(d.shape == (H, F) for d in down))
        shapes = (f"{len(gate_up)} gate_up {sorted({g.shape for g in gate_up})}, "
                  f"{len(down)} down {sorted({d.shape for d in down})}")
        dtypes = {a.dtype for a in (*gate_up, *down)}
    if not ok:
        raise ValueError(f"{what}: {shapes} for {E} experts of hidden size {H}: expected E gate_up [2F, H] and E "
                         f"down [H, F], or one gate_up [E, 2F, H] and one down [E, H, F]")
    if dtypes - {jnp.dtype(dtype)}:
        raise ValueError(f"{what}: weight dtypes {sorted(map(str, dtypes))}, expected {jnp.dtype(dtype)} like x")
    return stacked, F


def _routing(x: Any, tokens: Any, pair_weight: Any, offsets: Any, what: str) -> tuple[Any, Any, Any]:
    tokens, pair_weight, offsets = jnp.asarray(tokens), jnp.asarray(pair_weight), jnp.asarray(offsets)
    if x.ndim != 2:
        raise ValueError(f"{what}: x {x.shape}, expected [T, H]")
    if (tokens.ndim != 1 or pair_weight.shape != tokens.shape or offsets.ndim != 1 or offsets.shape[0] < 1
            or not jnp.issubdtype(tokens.dtype, jnp.integer) or not jnp.issubdtype(offsets.dtype, jnp.integer)):
        raise ValueError(f"{what}: tokens {tokens.dtype}{list(tokens.shape)}, pair_weight "
                         f"{pair_weight.dtype}{list(pair_weight.shape)}, offsets {offsets.dtype}{list(offsets.shape)}:"
                         f" expected integer [P], float [P] and integer [E + 1]")
    return tokens.astype(jnp.int32), pair_weight.astype(jnp.float32), offsets.astype(jnp.int32)


def experts(x: jax.Array, tokens: jax.Array, pair_weight: jax.Array, offsets: jax.Array,
            gate_up: Sequence[jax.Array] | jax.Array, down: Sequence[jax.Array] | jax.Array, *,
            strategy: str = "auto") -> jax.Array:
    """All the routed SwiGLU experts of one MoE layer in one CPU FFI call, exactly over their live pairs.

    x [T, H] (bf16, or f32); tokens int32 [P]: the row of x of each (token, expert) pair, pairs sorted by
    expert; pair_weight f32 [P]; offsets int32 [E + 1]: expert e's pairs are offsets[e] .. offsets[e+1]-1,
    and pairs outside offsets[0] .. offsets[E]-1 are padding, never read (any value); gate_up: E arrays
    [2F, H] (gate rows first) or one stacked [E, 2F, H]; down: E arrays [H, F] or one [E, H, F]; weights of
    x's dtype. Returns f32 [T, H]: out[t] = sum over live pairs p with tokens[p] == t of
    pair_weight[p] * expert_e(x[t]), experts added in expert order (rows without a pair are 0).

    Numerics are `swiglu`'s (bf16: g, u and h rounded to bf16, the down projection summed in f32,
    unrounded), each pair's product pair_weight * y rounded once to f32 before it is added; deterministic,
    bit for bit the same for any thread count and `strategy` ("auto", "rows", "experts": see
    `experts_host`). Each used expert's weights are read once per call (per 128 rows of its pairs); an
    expert without pairs is never read. Offsets must satisfy 0 <= offsets[0] <= ... <= offsets[E] <= P and
    live pairs' tokens lie in [0, T): otherwise the call fails at run time. Pass the weights as separate jit
    arguments (or loop-carried / closed-over arrays), not as slices of a stacked array (XLA would copy
    each slice): the stacked form takes the stacked array whole.

    This is a raw CPU-only custom call (lowering for another backend fails): wrap it in
    `lax.platform_dependent(..., cpu=experts, default=<XLA path>)`, e.g. with `experts_reference`, and
    check `available_experts()` first (RuntimeError without the library). Usable under jit, while_loop,
    cond, switch; not differentiable. Block-quantized experts (lists of `QuantArray`s): `qexperts`."""
    if isinstance(gate_up, (list, tuple)) and gate_up and _is_quant(gate_up[0]):
        return qexperts(x, tokens, pair_weight, offsets, gate_up, down, strategy=strategy)
    tokens, pair_weight, offsets = _routing(x, tokens, pair_weight, offsets, "experts")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"experts: x dtype {x.dtype}, expected bfloat16 or float32")
    T, H = x.shape
    E = offsets.shape[0] - 1
    stacked, _ = _expert_weights(gate_up, down, E, H, x.dtype, "experts")
    code = _strategy(strategy)
    if not available_experts():
        raise RuntimeError(f"models.native.experts: library unavailable ({_error or 'no XLA FFI support'})")
    weights = [gate_up, down] if stacked else [*gate_up, *down]
    target = "moescope_experts" if x.dtype == jnp.bfloat16 else "moescope_experts_f32"
    out = jax.ShapeDtypeStruct((T, H), jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x, tokens, pair_weight, offsets, *weights,
                                                                     strategy=np.int32(code))


def experts_reference(x: jax.Array, tokens: jax.Array, pair_weight: jax.Array, offsets: jax.Array,
                      gate_up: Sequence[jax.Array] | jax.Array, down: Sequence[jax.Array] | jax.Array) -> jax.Array:
    """Pure-XLA `experts`, same arguments and result (any backend): a scan over the experts, each expert
    run by `swiglu_reference` on all P pair rows and masked to its own live pairs, weighted, and added
    into its tokens' rows (expert order). E times the work of the live pairs: a reference, and a last-resort
    fallback. Padding pairs may hold any value (clamped, masked)."""
    tokens, pair_weight, offsets = _routing(x, tokens, pair_weight, offsets, "experts_reference")
    T, H = x.shape
    P, E = tokens.shape[0], offsets.shape[0] - 1
    stacked, _ = _expert_weights(gate_up, down, E, H, x.dtype, "experts_reference")
    out = jnp.zeros((T, H), jnp.float32)
    if E == 0 or P == 0 or T == 0:
        return out
    gu = gate_up if stacked else jnp.stack(list(gate_up))
    dn = down if stacked else jnp.stack(list(down))
    tok = jnp.clip(tokens, 0, T - 1)
    rows = x[tok]
    p = jnp.arange(P, dtype=jnp.int32)

    def one(out, item):
        e, gu_e, dn_e = item
        live = (p >= offsets[e]) & (p < offsets[e + 1])
        y = swiglu_reference(rows, gu_e, dn_e)
        return out.at[tok].add(jnp.where(live[:, None], pair_weight[:, None] * y, 0.0)), None

    return lax.scan(one, out, (jnp.arange(E, dtype=jnp.int32), gu, dn))[0]


# ---- host (ctypes) -------------------------------------------------------------------------------

def _host_array(a: Any, what: str, writeable: bool = False) -> tuple[int, np.dtype, tuple[int, ...]]:
    """(address, numpy dtype, shape) of a C-contiguous CPU numpy array or torch tensor; ValueError otherwise."""
    if isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:
            raise ValueError(f"{what}: must be C-contiguous")
        if writeable and not a.flags.writeable:
            raise ValueError(f"{what}: must be writeable")
        return a.__array_interface__["data"][0], a.dtype, a.shape
    if type(a).__module__.split(".")[0] == "torch":
        import torch

        if a.device.type != "cpu":
            raise ValueError(f"{what}: torch tensor on {a.device}, expected the CPU")
        if not a.is_contiguous():
            raise ValueError(f"{what}: torch tensor must be contiguous")
        dt = {torch.bfloat16: _BF16, torch.float32: _F32}.get(a.dtype)
        if dt is None:
            raise ValueError(f"{what}: torch dtype {a.dtype}, expected torch.bfloat16 or torch.float32")
        return a.data_ptr(), dt, tuple(a.shape)
    raise ValueError(f"{what}: {type(a).__name__}, expected a numpy array or a torch tensor")


def _wdtype(dt: np.dtype, what: str) -> int:
    if dt == _BF16:
        return _W_BF16
    if dt == _F32:
        return _W_F32
    raise ValueError(f"{what}: dtype {dt}, expected bfloat16 (ml_dtypes / torch) or float32")


class ExpertWeights:
    """Validated weights of several SwiGLU experts (gate [F, H], up [F, H], down [H, F] each), with their
    addresses packed for `experts_host`: all bf16 or all f32 arrays (numpy / torch), or all block-quantized
    (`models.quant.blocks.QuantArray` with host numpy data; gates share one block type, ups one, downs one, as
    a GGUF layer's stacked expert tensors do). Holds references to the arrays. Pack a layer's experts once
    and pass the result to `experts_host` to skip the per-call checks."""

    def __init__(self, gates: Sequence[Any], ups: Sequence[Any], downs: Sequence[Any]):
        n = len(gates)
        if len(ups) != n or len(downs) != n:
            raise ValueError(f"experts: {n} gates, {len(ups)} ups, {len(downs)} downs")
        self.arrays = (list(gates), list(ups), list(downs))
        self.n = n
        self.hidden = self.intermediate = 0
        self.wdtype = _W_BF16  # set from the first weight
        self.dtype: Optional[np.dtype] = None
        self.qtypes: Optional[tuple[str, str, str]] = None  # block types of gate, up, down when quantized
        ptrs = np.zeros((3, n), np.uintp)
        if n and _is_quant(gates[0]):
            self._pack_quant(gates, ups, downs, ptrs)
        for e in range(n if self.qtypes is None else 0):
            for j, (arr, name) in enumerate(zip((gates[e], ups[e], downs[e]), ("gate", "up", "down"))):
                addr, dt, shape = _host_array(arr, f"expert {e} {name}")
                if self.dtype is None:
                    self.dtype = dt
                    self.wdtype = _wdtype(dt, f"expert {e} {name}")
                    if len(shape) != 2:
                        raise ValueError(f"expert {e} {name}: shape {shape}, expected [F, H]")
                    self.intermediate, self.hidden = shape
                elif dt != self.dtype:
                    raise ValueError(f"expert {e} {name}: dtype {dt}, expected {self.dtype} like the first weight")
                want = (self.hidden, self.intermediate) if name == "down" else (self.intermediate, self.hidden)
                if tuple(shape) != want:
                    raise ValueError(f"expert {e} {name}: shape {tuple(shape)}, expected {list(want)}")
                ptrs[j, e] = addr
        self.ptrs = ptrs
        self.addresses = tuple(int(row.ctypes.data) for row in ptrs)  # what each call passes

    def _pack_quant(self, gates: Sequence[Any], ups: Sequence[Any], downs: Sequence[Any], ptrs: np.ndarray) -> None:
        F, H = gates[0].shape
        self.intermediate, self.hidden = F, H
        self.qtypes = (gates[0].qtype, ups[0].qtype, downs[0].qtype)
        for e in range(self.n):
            for j, (arr, name) in enumerate(zip((gates[e], ups[e], downs[e]), ("gate", "up", "down"))):
                want = (H, F) if name == "down" else (F, H)
                if not _is_quant(arr) or arr.qtype != self.qtypes[j] or tuple(arr.shape) != want:
                    got = f"{arr.qtype} {tuple(arr.shape)}" if _is_quant(arr) else type(arr).__name__
                    raise ValueError(f"expert {e} {name}: {got}, expected a {self.qtypes[j]} QuantArray {list(want)} "
                                     f"like expert 0's")
                ptrs[j, e] = _quant_address(arr, f"expert {e} {name}")


def pack_experts(gates: Sequence[Any], ups: Sequence[Any], downs: Sequence[Any]) -> ExpertWeights:
    """`ExpertWeights` of these experts (validated once; reuse it across calls)."""
    return ExpertWeights(gates, ups, downs)


def _check_vec(a: Any, dtype: Any, n: Optional[int], what: str, writeable: bool = False) -> int:
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1 or (n is not None and a.shape[0] != n):
        got = f"{type(a).__name__} {getattr(a, 'dtype', '')} {getattr(a, 'shape', '')}"
        raise ValueError(f"{what}: {got}, expected a numpy {np.dtype(dtype)} vector"
                         + (f" of {n}" if n is not None else ""))
    if not a.flags.c_contiguous or (writeable and not a.flags.writeable):
        raise ValueError(f"{what}: must be contiguous" + (" and writeable" if writeable else ""))
    return a.__array_interface__["data"][0]


def _out_rows(out: np.ndarray, xshape: tuple[int, ...]) -> tuple[int, int, int]:
    """(address, T, H) of a layer call's f32 [T, H] output, checked against x's shape."""
    oa, odt, oshape = _host_array(out, "out", writeable=True)
    if odt != _F32 or len(oshape) != 2:
        raise ValueError(f"out: {odt} {oshape}, expected float32 [T, H]")
    T, H = oshape
    if tuple(xshape) != (T, H):
        raise ValueError(f"x: shape {tuple(xshape)}, expected {[T, H]} like out")
    return oa, T, H


def _pair_vectors(n: int, offsets: np.ndarray, tokens: np.ndarray, pair_weight: np.ndarray,
                  seconds: Optional[np.ndarray]) -> tuple[int, int, int, int, Optional[int]]:
    """Addresses of a layer call's routing vectors for n experts: (offsets, pair count, tokens, pair weights,
    seconds or None)."""
    offs = _check_vec(offsets, np.int64, n + 1, "offsets")
    n_pairs = int(tokens.shape[0]) if isinstance(tokens, np.ndarray) else -1
    toks = _check_vec(tokens, np.int32, None, "tokens")
    pws = _check_vec(pair_weight, np.float32, n_pairs, "pair_weight")
    secs = None if seconds is None else _check_vec(seconds, np.float64, n, "seconds", writeable=True)
    return offs, n_pairs, toks, pws, secs


def experts_host(out: np.ndarray, x: Any, gates: Sequence[Any] | ExpertWeights, ups: Optional[Sequence[Any]],
                 downs: Optional[Sequence[Any]], offsets: np.ndarray, tokens: np.ndarray, pair_weight: np.ndarray,
                 threads: int = 1, seconds: Optional[np.ndarray] = None, strategy: str = "auto") -> None:
    """All the CPU experts of a layer in one native call (the GIL is released while it runs).

    out f32 [T, H] (C-contiguous, accumulated in place); x [T, H] C-contiguous, bf16 (ml_dtypes or torch)
    for bf16 weights, f32 for f32 weights; gates[e], ups[e] [F, H] and downs[e] [H, F] for each of n
    experts (numpy arrays or torch tensors, C-contiguous, possibly read-only; never written), or
    `gates` an `ExpertWeights` and ups = downs = None; offsets int64 [n + 1]: expert e's pairs are
    offsets[e] .. offsets[e+1]; tokens int32 [n_pairs]: the row of x of each pair; pair_weight f32
    [n_pairs]. Adds pair_weight[p] * expert(x[tokens[p]]) into out[tokens[p]] for every pair, experts
    in order: the result does not depend on `threads` (<= 0: the library default, see `set_threads`).
    seconds: optional f64 [n], each expert's wall time (0 for experts without pairs).
    strategy: how threads share the work, never what is computed (bit-identical results): "rows" splits
    each expert's output rows over the threads, expert after expert; "experts" gives whole experts to
    threads (each into a scratch block, added into out in expert order at the end); "auto" (default)
    chooses: whole experts for several small ones at decode sizes, rows for large experts (over 64 MiB
    of weights, `MOESCOPE_NATIVE_EP_MAX_MB` changes it), large batches, or one expert that dominates.
    Experts without pairs are never read."""
    lib = _need()
    w = gates if isinstance(gates, ExpertWeights) else ExpertWeights(gates, ups or (), downs or ())
    if w.qtypes is not None:
        return _qexperts_host(lib, out, x, w, offsets, tokens, pair_weight, threads, seconds, strategy)
    xa, xdt, xshape = _host_array(x, "x")
    oa, T, H = _out_rows(out, xshape)
    if w.n and w.hidden != H:
        raise ValueError(f"experts: hidden size {w.hidden}, but x and out have {H}")
    if w.n and xdt != w.dtype:
        raise ValueError(f"x: dtype {xdt}, expected {w.dtype} like the weights")
    wdtype = w.wdtype if w.n else _wdtype(xdt, "x")
    offs, n_pairs, toks, pws, secs = _pair_vectors(w.n, offsets, tokens, pair_weight, seconds)
    rc = lib.ms_experts(xa, T, H, w.intermediate, wdtype, w.n, *w.addresses, offs, n_pairs, toks, pws, oa, int(threads), secs,
                        _strategy(strategy))
    if rc != 0:
        raise ValueError(lib.ms_last_error().decode())


def linear_host(x: Any, w: Any, threads: int = 1) -> np.ndarray:
    """f32 [..., N] = x [..., K] times w [N, K]^T (x bf16 for bf16 w, f32 for f32 w; C-contiguous numpy or
    torch CPU arrays), with `threads` threads (<= 0: the library default). w may be a block-quantized
    `QuantArray` (host data): then x is bf16 or f32 and is quantized as llama.cpp does (see `qlinear_reference`)."""
    lib = _need()
    if _is_quant(w):
        return _qlinear_host(lib, x, w, threads)
    xa, xdt, xshape = _host_array(x, "x")
    wa, wdt, wshape = _host_array(w, "w")
    wdtype = _wdtype(wdt, "w")
    if xdt != wdt:
        raise ValueError(f"x: dtype {xdt}, expected {wdt} like w")
    if len(wshape) != 2 or len(xshape) < 1 or xshape[-1] != wshape[1]:
        raise ValueError(f"x {tuple(xshape)}, w {tuple(wshape)}: expected x [..., K], w [N, K]")
    K, N = wshape[1], wshape[0]
    M = int(np.prod(xshape[:-1], dtype=np.int64))
    y = np.empty((*xshape[:-1], N), np.float32)
    if lib.ms_linear(xa, M, K, wa, N, y.ctypes.data, wdtype, int(threads)) != 0:
        raise ValueError(lib.ms_last_error().decode())
    return y


def stream_read(a: np.ndarray, threads: int = 1) -> float:
    """Reads all of `a` (C-contiguous) once with the native streaming kernel on `threads` threads and returns
    a checksum: time it for the machine's memory read rate."""
    lib = _need()
    addr, _, _ = _host_array(a, "a")
    return float(lib.ms_read(addr, a.nbytes, int(threads)))


def count_nonfinite(a: np.ndarray, threads: int = 0) -> int:
    """NaN and Inf values in a contiguous float16 / bfloat16 / float32 array (integers: 0), read once at memory
    speed; numpy in chunks where the kernels are not built."""
    if a.dtype.kind not in "fV" and a.dtype != _BF16:
        return 0
    bits = a.dtype.itemsize * 8
    if bits not in (16, 32):
        return int(np.count_nonzero(~np.isfinite(a)))
    lib = load()
    if lib is not None and a.flags.c_contiguous:
        return int(lib.ms_nonfinite(a.ctypes.data, a.size, bits, int(a.dtype == _BF16), int(threads)))
    raw = a.reshape(-1).view(np.uint32 if bits == 32 else np.uint16)
    mask = {32: 0x7F800000, 16: 0x7F80 if a.dtype == _BF16 else 0x7C00}[bits]
    step = 1 << 24
    return sum(int(np.count_nonzero((raw[i:i + step] & mask) == mask)) for i in range(0, raw.size, step))


# ---- block-quantized weights (ggml layouts; models.quant.blocks.QuantArray) --------------------------------
#
# Activation rounding, as llama.cpp's CPU backend does before its integer dot products: for Q8_0 / Q4_0
# weights each row of x is quantized per 32 values to Q8_0 (d = max|x| / 127 stored as f16, q = roundf(x / d)
# computed with the unrounded d); for Q4_K / Q6_K per 256 values to Q8_K (f32 d = max / -127 where max is the
# value of largest magnitude, q = round-half-even(x * (-127 / max)), at most 127). The kernels then compute
# exact integer sums per weight-scale group, scaled in f32: each result equals `qlinear_reference` (dequantized
# quantized activations times the dequantized blocks, an f32/f64 matmul) to within f32 summation error. A
# quantized SwiGLU expert keeps g = x gate^T and u = x up^T in f32, h = silu(g) * u in f32, quantizes h the
# same way for the down projection, and returns f32.

QTYPE_IDS = {"q4_0": 2, "q8_0": 8, "q4_k": 12, "q6_k": 14}


def reads_blocks(*qtypes: str) -> bool:
    """Whether the native kernels read every one of these block types (and the library is there)."""
    return available() and all(q in QTYPE_IDS for q in qtypes)
_XBLK = {"q4_0": 32, "q8_0": 32, "q4_k": 256, "q6_k": 256}


def _is_quant(a: Any) -> bool:
    return hasattr(a, "qtype") and hasattr(a, "data") and not hasattr(a, "dtype")


def _qtype_id(qtype: str, what: str) -> int:
    if qtype not in QTYPE_IDS:
        raise ValueError(f"{what}: block type {qtype!r} has no native kernel; supported: {', '.join(QTYPE_IDS)}")
    return QTYPE_IDS[qtype]


def _quant_address(w: Any, what: str) -> int:
    _qtype_id(w.qtype, what)
    data = w.data
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or not data.flags.c_contiguous:
        raise ValueError(f"{what}: QuantArray data must be a C-contiguous numpy uint8 array (host memory)")
    return data.__array_interface__["data"][0]


def _x_rows(x: Any, what: str = "x") -> tuple[int, int, tuple[int, ...]]:
    """(address, 1 if bf16 else 0, shape) of a bf16 or f32 activation array."""
    xa, xdt, xshape = _host_array(x, what)
    if xdt not in (_BF16, _F32):
        raise ValueError(f"{what}: dtype {xdt}, expected bfloat16 or float32 for block-quantized weights")
    return xa, int(xdt == _BF16), tuple(xshape)


def _qlinear_host(lib: ctypes.CDLL, x: Any, w: Any, threads: int) -> np.ndarray:
    xa, xbf, xshape = _x_rows(x)
    N, K = w.shape
    if len(xshape) < 1 or xshape[-1] != K:
        raise ValueError(f"x {xshape}, w {w.qtype} {tuple(w.shape)}: expected x [..., K], w [N, K]")
    M = int(np.prod(xshape[:-1], dtype=np.int64))
    y = np.empty((*xshape[:-1], N), np.float32)
    if lib.ms_qlinear(xa, xbf, M, K, _quant_address(w, "w"), QTYPE_IDS[w.qtype], N, y.ctypes.data, int(threads)) != 0:
        raise ValueError(lib.ms_last_error().decode())
    return y


def _qexperts_host(lib: ctypes.CDLL, out: np.ndarray, x: Any, w: ExpertWeights, offsets: np.ndarray,
                   tokens: np.ndarray, pair_weight: np.ndarray, threads: int, seconds: Optional[np.ndarray],
                   strategy: str) -> None:
    xa, xbf, xshape = _x_rows(x)
    oa, T, H = _out_rows(out, xshape)
    if w.hidden != H:
        raise ValueError(f"experts: hidden size {w.hidden}, but x and out have {H}")
    offs, n_pairs, toks, pws, secs = _pair_vectors(w.n, offsets, tokens, pair_weight, seconds)
    qg, qu, qd = (QTYPE_IDS[q] for q in w.qtypes)
    rc = lib.ms_qexperts(xa, xbf, T, H, w.intermediate, qg, qu, qd, w.n, *w.addresses, offs, n_pairs, toks, pws, oa,
                         int(threads), secs, _strategy(strategy))
    if rc != 0:
        raise ValueError(lib.ms_last_error().decode())


def _round_away(v: np.ndarray) -> np.ndarray:
    """C's roundf (halves away from zero), exactly, in float32."""
    t = np.trunc(v)
    return np.where(np.abs(v - t) == np.float32(0.5), t + np.sign(v), np.rint(v)).astype(np.float32)


def quantize_activations(x: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' activation rounding for weights of `qtype`, in numpy: x f32 [M, K] -> (q int8 [M, K],
    d f32 [M, K / B]) with x ~ d * q per block of B = 32 (Q8_0: Q8_0 / Q4_0 weights) or 256 (Q8_K: Q4_K /
    Q6_K weights), computed as llama.cpp's quantize_row_q8_0 / quantize_row_q8_K do."""
    B = _XBLK[qtype] if qtype in _XBLK else _qtype_id(qtype, "quantize_activations")
    x = np.asarray(x, np.float32)
    M, K = x.shape
    if K % B:
        raise ValueError(f"quantize_activations: {K} columns are not a whole number of {B}-value blocks")
    v = x.reshape(M, K // B, B)
    with np.errstate(divide="ignore", invalid="ignore"):
        if B == 32:
            amax = np.abs(v).max(-1)
            d = (amax / np.float32(127)).astype(np.float32)
            inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
            q = _round_away(v * inv[..., None])
            d = d.astype(np.float16).astype(np.float32)  # stored as f16, round to nearest even
        else:
            idx = np.abs(v).argmax(-1)
            mx = np.take_along_axis(v, idx[..., None], -1)[..., 0]
            zero = mx == 0
            iscale = np.where(zero, np.float32(0), np.float32(-127) / np.where(zero, 1, mx)).astype(np.float32)
            q = np.minimum(np.float32(127), np.rint(v * iscale[..., None]))
            d = np.where(zero, np.float32(0), np.float32(1) / np.where(zero, 1, iscale)).astype(np.float32)
    return q.astype(np.int8).reshape(M, K), d.astype(np.float32)


def dequantize(w: Any) -> np.ndarray:
    """f32 [rows, cols] of a block-quantized `QuantArray` (gguf.quants.dequantize: the reference)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    t = GGMLQuantizationType(_qtype_id(w.qtype, "dequantize"))
    return np.asarray(gguf_dequantize(np.asarray(w.data), t), np.float32).reshape(w.shape)


def block_rounding(qtype: str, rows: int) -> str:
    """How the kernels round a call of `rows` activation rows on block weights of `qtype` on the current ISA path:
    "q8" (activations quantized to Q8_0 / Q8_K as llama.cpp does, weights exact: the vector paths) or "bf16" (the
    AMX tiles, from a per-type row count: weights dequantized then rounded to bf16, activations rounded to bf16)."""
    lib = load()
    qid = _qtype_id(qtype, "block_rounding")
    return "bf16" if lib is not None and lib.ms_qpath(qid, int(rows)) == 2 else "q8"


def set_amx_rows(qtype: str, rows: Optional[int]) -> None:
    """Rows from which block type `qtype` takes the AMX tiles on the "amx" path (None: the measured default; a
    negative count: never). Process-wide; meant for tests and benchmarks."""
    lib = _need()
    if lib.ms_set_amx_rows(_qtype_id(qtype, "set_amx_rows"), 0 if rows is None else int(rows)) != 0:
        raise ValueError(lib.ms_last_error().decode())


def _bf16_f32(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float32).astype(_BF16).astype(np.float32)


def rounded_operands(x: Any, w: Any, rounding: Optional[str] = None) -> tuple[np.ndarray, np.ndarray]:
    """The operands the kernels multiply for x [..., K] and block weights w [N, K], as f32 arrays (x's shape,
    [N, K]): `rounding` "q8" -- x quantized for w's type (`quantize_activations`), w dequantized (`dequantize`) --
    or "bf16" -- both rounded to bf16 (nearest even) after that dequantization; None: what the kernels do for that
    many rows on the current ISA path (`block_rounding`)."""
    xf = np.asarray(x, np.float32)
    rows = int(np.prod(xf.shape[:-1]))
    rounding = rounding or block_rounding(w.qtype, rows)
    wd = dequantize(w)
    if rounding == "bf16":
        return _bf16_f32(xf), _bf16_f32(wd)
    if rounding != "q8":
        raise ValueError(f"rounded_operands: rounding must be 'q8' or 'bf16', not {rounding!r}")
    q, d = quantize_activations(xf.reshape(-1, xf.shape[-1]), w.qtype)
    B = _XBLK[w.qtype]
    return (q.astype(np.float32).reshape(q.shape[0], -1, B) * d[..., None]).reshape(xf.shape), wd


def qlinear_reference(x: Any, w: Any, rounding: Optional[str] = None) -> np.ndarray:
    """What `linear_host(x, w)` computes for a QuantArray w, in numpy: x and w rounded as the kernels round them
    (`rounded_operands`: Q8 activations, or bf16 weights and activations on the AMX tiles), multiplied and summed in
    f64, returned f32 [..., N]."""
    xr, wr = rounded_operands(x, w, rounding)
    return (xr.astype(np.float64) @ wr.astype(np.float64).T).astype(np.float32)


def qswiglu_reference(x: Any, gate: Any, up: Any, down: Any) -> np.ndarray:
    """A block-quantized SwiGLU expert in numpy: g, u = `qlinear_reference` (f32), h = silu(g) * u (f32), then
    `qlinear_reference(h, down)`: f32 [..., H] (each projection rounded as the kernels round its rows)."""
    g = qlinear_reference(x, gate)
    u = qlinear_reference(x, up)
    h = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
    return qlinear_reference(h, down)


def qexperts_host_reference(out0: np.ndarray, x: Any, gates: Sequence[Any], ups: Sequence[Any], downs: Sequence[Any],
                       offsets: np.ndarray, tokens: np.ndarray, pair_weight: np.ndarray) -> np.ndarray:
    """What `experts_host` adds for block-quantized experts, in numpy: out0 + sum over pairs of
    pair_weight * `qswiglu_reference`(x[token]) (f32 [T, H], a new array)."""
    out = np.array(out0, np.float32, copy=True)
    xf = np.asarray(x, np.float32)
    for e in range(len(gates)):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi > lo:
            tok = np.asarray(tokens[lo:hi])
            y = qswiglu_reference(xf[tok], gates[e], ups[e], downs[e])
            np.add.at(out, tok, (pair_weight[lo:hi, None] * y).astype(np.float32))
    return out


# ---- block-quantized weights in JAX (XLA FFI on the CPU backend, the same math in XLA elsewhere) ------------

def _jnp_f16(b: jax.Array) -> jax.Array:
    """f32 of little-endian f16 bytes b [..., 2] (uint8)."""
    return lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _jnp_scale_min_k4(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K's 8 six-bit scales and mins from its 12 scale bytes s [..., 12] (ggml's get_scale_min_k4)."""
    s = s.astype(jnp.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return jnp.concatenate([lo_sc, hi_sc], -1), jnp.concatenate([lo_m, hi_m], -1)


def dequantize_jax(data: jax.Array, qtype: str, cols: int) -> jax.Array:
    """f32 [rows, cols] of block data uint8 [rows, row_bytes] of `qtype` (ggml's dequantize_row_*, in XLA)."""
    _qtype_id(qtype, "dequantize_jax")
    rows = data.shape[0]
    b = data.reshape(rows, -1, {"q8_0": 34, "q4_0": 18, "q4_k": 144, "q6_k": 210}[qtype])
    if qtype == "q8_0":
        w = _jnp_f16(b[..., 0:2])[..., None] * lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
    elif qtype == "q4_0":
        qs = b[..., 2:18].astype(jnp.int32)
        q = jnp.concatenate([qs & 15, qs >> 4], -1) - 8
        w = _jnp_f16(b[..., 0:2])[..., None] * q.astype(jnp.float32)
    elif qtype == "q4_k":
        sc, m = _jnp_scale_min_k4(b[..., 4:16])
        qs = b[..., 16:].astype(jnp.int32).reshape(rows, -1, 4, 32)
        q = jnp.stack([qs & 15, qs >> 4], -2).reshape(rows, -1, 8, 32).astype(jnp.float32)
        d = _jnp_f16(b[..., 0:2])[..., None] * sc.astype(jnp.float32)
        dm = _jnp_f16(b[..., 2:4])[..., None] * m.astype(jnp.float32)
        w = d[..., None] * q - dm[..., None]
    else:
        ql = b[..., :128].astype(jnp.int32).reshape(rows, -1, 2, 2, 32)
        qh = b[..., 128:192].astype(jnp.int32).reshape(rows, -1, 2, 32)
        A, B = ql[..., 0, :], ql[..., 1, :]
        q = jnp.stack([(A & 15) | ((qh & 3) << 4), (B & 15) | (((qh >> 2) & 3) << 4),
                       (A >> 4) | (((qh >> 4) & 3) << 4), (B >> 4) | (((qh >> 6) & 3) << 4)], -2)
        q = (q.reshape(rows, -1, 16, 16) - 32).astype(jnp.float32)
        sc = lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
        w = (_jnp_f16(b[..., 208:210])[..., None] * sc)[..., None] * q
    return w.reshape(rows, cols)


def _jnp_round_x(x: jax.Array, qtype: str) -> jax.Array:
    """x f32 [M, K] after the kernels' activation rounding for `qtype` (see `quantize_activations`)."""
    B = _XBLK[qtype]
    M, K = x.shape
    v = x.astype(jnp.float32).reshape(M, K // B, B)
    if B == 32:
        d = jnp.abs(v).max(-1) / jnp.float32(127)
        inv = jnp.where(d != 0, 1 / jnp.where(d != 0, d, 1), 0)
        s = v * inv[..., None]
        t = jnp.trunc(s)
        q = jnp.where(jnp.abs(s - t) == 0.5, t + jnp.sign(s), jnp.round(s))
        d = d.astype(jnp.float16).astype(jnp.float32)
    else:
        idx = jnp.abs(v).argmax(-1)
        mx = jnp.take_along_axis(v, idx[..., None], -1)[..., 0]
        zero = mx == 0
        iscale = jnp.where(zero, 0, jnp.float32(-127) / jnp.where(zero, 1, mx))
        q = jnp.minimum(127, jnp.round(v * iscale[..., None]))
        d = jnp.where(zero, 0, 1 / jnp.where(zero, 1, iscale))
    return (q * d[..., None]).reshape(M, K)


def qlinear_jax_reference(x: jax.Array, data: jax.Array, qtype: str) -> jax.Array:
    """Pure-XLA block-quantized linear: x [M, K] rounded as the kernels round it, times the dequantized
    blocks data uint8 [N, row_bytes] transposed, f32 [M, N] (HIGHEST precision dot)."""
    w = dequantize_jax(data, qtype, x.shape[-1])
    return jnp.dot(_jnp_round_x(x, qtype), w.T, precision=lax.Precision.HIGHEST)


def _qswiglu_jax(x: jax.Array, gate_up: jax.Array, down: jax.Array, qgu: str, qdown: str) -> jax.Array:
    F = gate_up.shape[0] // 2
    gu = qlinear_jax_reference(x, gate_up, qgu)
    g, u = gu[:, :F], gu[:, F:]
    return qlinear_jax_reference(jax.nn.silu(g) * u, down, qdown)


_q_fns: dict = {}


def _q_fn(kind: str, *key: Any) -> Callable[..., jax.Array]:
    """native_or(FFI call, XLA reference) for one block type combination (the types are static attributes)."""
    if (kind, *key) in _q_fns:
        return _q_fns[(kind, *key)]
    if kind == "linear":
        (qt,) = key

        def ffi_fn(x2: jax.Array, data: jax.Array) -> jax.Array:
            out = jax.ShapeDtypeStruct((x2.shape[0], data.shape[0]), jnp.float32)
            return jax.ffi.ffi_call("moescope_qlinear", out, vmap_method="sequential")(
                x2, data, qtype=np.int32(QTYPE_IDS[qt]))

        fn = native_or(ffi_fn, lambda x2, data: qlinear_jax_reference(x2, data, qt))
    else:
        qgu, qdown = key

        def ffi_fn(x2: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
            out = jax.ShapeDtypeStruct((x2.shape[0], x2.shape[1]), jnp.float32)
            return jax.ffi.ffi_call("moescope_qswiglu", out, vmap_method="sequential")(
                x2, gate_up, down, qgu=np.int32(QTYPE_IDS[qgu]), qdown=np.int32(QTYPE_IDS[qdown]),
                F=np.int64(gate_up.shape[0] // 2))

        fn = native_or(ffi_fn, lambda x2, gu, dn: _qswiglu_jax(x2, gu, dn, qgu, qdown))
    _q_fns[(kind, *key)] = fn
    return fn


def _q_native_ok(x: Any) -> bool:
    return x.dtype in (jnp.bfloat16, jnp.float32) and available_experts()


def qlinear(x: jax.Array, w: Any) -> jax.Array:
    """x [..., K] times a block-quantized w (`QuantArray` [N, K], data a jax uint8 array) -> [..., N] in x's
    dtype (f32 sums rounded once). Activation rounding: see `quantize_activations`. CPU backend: the native
    FFI kernel; elsewhere (or without the library): `qlinear_jax_reference`. `linear(x, w)` calls this for a
    QuantArray w."""
    N, K = w.shape
    if x.ndim < 1 or x.shape[-1] != K:
        raise ValueError(f"linear: x {x.shape} and {w.qtype} w {tuple(w.shape)}: expected x [..., K] and w [N, K]")
    _qtype_id(w.qtype, "linear: w")
    x2 = x.reshape(-1, K)
    data = jnp.asarray(w.data)
    if _q_native_ok(x):
        y = _q_fn("linear", w.qtype)(x2, data)
    else:
        y = qlinear_jax_reference(x2.astype(jnp.float32), data, w.qtype)
    return y.astype(x.dtype).reshape(*x.shape[:-1], N)


def qswiglu(x: jax.Array, gate_up: Any, down: Any) -> jax.Array:
    """Block-quantized SwiGLU expert: x [..., H], gate_up `QuantArray` [2F, H] (gate rows first), down
    `QuantArray` [H, F] -> f32 [..., H] (g and u f32, h = silu(g) * u f32 and rounded for down's type as x is
    for gate_up's; see `qswiglu_reference`). `swiglu(x, gate_up, down)` calls this for QuantArrays."""
    h = x.shape[-1] if x.ndim else -1
    if (x.ndim < 1 or gate_up.shape[0] % 2 or gate_up.shape[1] != h or tuple(down.shape) != (h, gate_up.shape[0] // 2)):
        raise ValueError(f"swiglu: x {x.shape}, gate_up {gate_up.qtype} {tuple(gate_up.shape)}, down "
                         f"{down.qtype} {tuple(down.shape)}: expected x [..., H], gate_up [2F, H], down [H, F]")
    _qtype_id(gate_up.qtype, "swiglu: gate_up")
    _qtype_id(down.qtype, "swiglu: down")
    x2 = x.reshape(-1, h)
    gu, dn = jnp.asarray(gate_up.data), jnp.asarray(down.data)
    if _q_native_ok(x):
        y = _q_fn("swiglu", gate_up.qtype, down.qtype)(x2, gu, dn)
    else:
        y = _qswiglu_jax(x2.astype(jnp.float32), gu, dn, gate_up.qtype, down.qtype)
    return y.reshape(*x.shape[:-1], h)


def qexperts_reference(x: jax.Array, tokens: jax.Array, pair_weight: jax.Array, offsets: jax.Array,
                       gate_up: Sequence[Any], down: Sequence[Any]) -> jax.Array:
    """Pure-XLA `experts` over block-quantized experts (lists of QuantArrays): each expert's `qswiglu`
    reference math on all pair rows, masked to its live pairs, weighted, added in expert order. f32 [T, H]."""
    tokens, pair_weight, offsets = _routing(x, tokens, pair_weight, offsets, "experts_reference")
    T, H = x.shape
    out = jnp.zeros((T, H), jnp.float32)
    P = tokens.shape[0]
    if P == 0 or T == 0:
        return out
    tok = jnp.clip(tokens, 0, T - 1)
    rows = x[tok].astype(jnp.float32)
    p = jnp.arange(P, dtype=jnp.int32)
    for e, (gu, dn) in enumerate(zip(gate_up, down)):
        live = (p >= offsets[e]) & (p < offsets[e + 1])
        y = _qswiglu_jax(rows, jnp.asarray(gu.data), jnp.asarray(dn.data), gu.qtype, dn.qtype)
        out = out.at[tok].add(jnp.where(live[:, None], pair_weight[:, None] * y, 0.0))
    return out


def qexperts(x: jax.Array, tokens: jax.Array, pair_weight: jax.Array, offsets: jax.Array, gate_up: Sequence[Any],
             down: Sequence[Any], *, strategy: str = "auto") -> jax.Array:
    """`experts` over block-quantized experts: gate_up E `QuantArray`s [2F, H], or E (gate, up) pairs of
    `QuantArray`s [F, H] each (a GGUF file's separate tensors, passed without joining them), one block type
    for gate and up; down E `QuantArray`s [H, F] (one block type); data jax uint8 arrays; the rest as `experts`
    (raw CPU-only FFI call, routing checked at run time, deterministic for any thread count and strategy).
    Numerics: `qswiglu`'s per pair, pair_weight * y rounded once to f32, added in expert order. `experts(...)`
    calls this for QuantArrays."""
    tokens, pair_weight, offsets = _routing(x, tokens, pair_weight, offsets, "experts")
    E = offsets.shape[0] - 1
    gate_up, down = list(gate_up), list(down)
    pairs = bool(gate_up) and isinstance(gate_up[0], tuple)
    firsts = [g[0] if pairs else g for g in gate_up]
    parts = [q for g in gate_up for q in (g if pairs else (g,))]
    if len(gate_up) != E or len(down) != E or not all(map(_is_quant, parts + down)):
        raise ValueError(f"experts: expected {E} gate_up and {E} down QuantArrays, got {len(gate_up)} and {len(down)}")
    T, H = x.shape
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"experts: x dtype {x.dtype}, expected bfloat16 or float32 with block-quantized experts")
    F = (firsts[0].shape[0] if pairs else firsts[0].shape[0] // 2) if E else 0
    gu_rows = F if pairs else 2 * F
    qgu = {q.qtype for q in parts}
    qdn = {d.qtype for d in down}
    if len(qgu) > 1 or len(qdn) > 1 or any(tuple(q.shape) != (gu_rows, H) for q in parts) or any(
            tuple(d.shape) != (H, F) for d in down):
        raise ValueError(f"experts: gate_up {sorted(qgu)} {sorted({tuple(q.shape) for q in parts})}, down "
                         f"{sorted(qdn)} {sorted({tuple(d.shape) for d in down})}: expected one block type each, "
                         f"gate_up [2F, H] (or gate and up [F, H]) and down [H, F] with H = {H}")
    if not available_experts():
        raise RuntimeError(f"models.native: library unavailable ({_error})")
    if E == 0:
        return jnp.zeros((T, H), jnp.float32)
    qg, qd = next(iter(qgu)), next(iter(qdn))
    out = jax.ShapeDtypeStruct((T, H), jnp.float32)
    if pairs:  # E gates, E ups, E downs
        args = [jnp.asarray(g[0].data) for g in gate_up] + [jnp.asarray(g[1].data) for g in gate_up]
    else:
        args = [jnp.asarray(g.data) for g in gate_up]
    args += [jnp.asarray(d.data) for d in down]
    return jax.ffi.ffi_call("moescope_qexperts", out, vmap_method="sequential")(
        x, tokens, pair_weight, offsets, *args, strategy=np.int32(_strategy(strategy)),
        qgu=np.int32(QTYPE_IDS[qg]), qdown=np.int32(QTYPE_IDS[qd]), F=np.int64(F))


def qexperts_stacked(x: jax.Array, tokens: jax.Array, pair_weight: jax.Array, offsets: jax.Array, gate: jax.Array,
                     up: jax.Array, down: jax.Array, qgu: str, qdown: str, *, strategy: str = "auto") -> jax.Array:
    """`qexperts` over a layer's experts held as three stacked block arrays (a GGUF file's expert tensors as they
    are): gate and up uint8 [E, F, row_bytes] of type `qgu`, down uint8 [E, H, row_bytes] of type `qdown`; the
    rest and the numerics as `qexperts` (the same kernel, reading expert e at e times its bytes). Three operands per
    layer where per-expert arrays are 3E: each operand is a parameter of the calling program, and XLA:CPU keeps
    per-parameter state in every compiled executable (Qwen3-30B-A3B's 128 experts: ~5 MB per layer per program)."""
    tokens, pair_weight, offsets = _routing(x, tokens, pair_weight, offsets, "experts")
    E = offsets.shape[0] - 1
    T, H = x.shape
    _qtype_id(qgu, "experts: gate/up")
    _qtype_id(qdown, "experts: down")
    F = int(gate.shape[1]) if gate.ndim == 3 else -1
    shapes = [tuple(a.shape) for a in (gate, up, down)]
    want = [(E, F, _qrow_bytes(qgu, H)), (E, F, _qrow_bytes(qgu, H)), (E, H, _qrow_bytes(qdown, F))]
    if F < 0 or shapes != want or any(a.dtype != jnp.uint8 for a in (gate, up, down)):
        raise ValueError(f"experts: stacked gate, up, down {shapes}: expected uint8 {want} ({qgu} gate/up, {qdown} "
                         f"down, {E} experts of hidden size {H})")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"experts: x dtype {x.dtype}, expected bfloat16 or float32 with block-quantized experts")
    if not available_experts():
        raise RuntimeError(f"models.native: library unavailable ({_error})")
    if E == 0:
        return jnp.zeros((T, H), jnp.float32)
    out = jax.ShapeDtypeStruct((T, H), jnp.float32)
    return jax.ffi.ffi_call("moescope_qexperts", out, vmap_method="sequential")(
        x, tokens, pair_weight, offsets, gate, up, down, strategy=np.int32(_strategy(strategy)),
        qgu=np.int32(QTYPE_IDS[qgu]), qdown=np.int32(QTYPE_IDS[qdown]), F=np.int64(F))


def _qrow_bytes(qtype: str, cols: int) -> int:
    from models.quant.blocks import BLOCK_TYPES

    return BLOCK_TYPES[qtype].row_bytes(cols)


_CODE_SCALE = {"q8_0": 64, "q4_0": 8, "q4_k": 32 * 8, "q6_k": 64 * 32}  # typical |code| (x sub-block scale)
_SCALE_AT = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}  # byte offsets of a block's f16 scales


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int, scale: float = 0.01) -> Any:
    """A random block-quantized `QuantArray` [rows, cols] of `qtype` (tests, benchmarks): random code bytes, f16
    block scales (and Q4_K mins) of random sign chosen so that weights are about `scale` in magnitude."""
    from models.quant.blocks import BLOCK_TYPES, QuantArray

    t = BLOCK_TYPES[qtype]
    nb = cols // t.block_elems
    data = rng.integers(0, 256, size=(rows, nb, t.block_bytes), dtype=np.uint8)
    s = scale / _CODE_SCALE[qtype]
    for at in _SCALE_AT[qtype]:
        v = rng.uniform(0.25, 1.0, size=(rows, nb)) * s * rng.choice(np.array([-1.0, 1.0]), size=(rows, nb))
        data[:, :, at:at + 2] = v.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return QuantArray(data.reshape(rows, nb * t.block_bytes), qtype, (rows, cols))
