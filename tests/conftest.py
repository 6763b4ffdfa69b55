"""Test session setup: 8 host devices for shard_map tests (before jax is imported anywhere), and one
persistent JAX compilation cache per test session.

The cache lives in a fresh temporary folder removed when the session ends, so nothing carries over
between runs; inside a run, identical computations compiled again (a new `Generator` or executor for
the same model and shapes, the entry points' subprocesses, which inherit the environment) load the
executable XLA already built instead of compiling it again. Set JAX_COMPILATION_CACHE_DIR to choose
the folder yourself (it is then kept).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="moescope-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")


import pytest  # noqa: E402  (after the environment above, which must precede any jax import)

NATIVE_ISAS = ["amx", "avx512bf16", "avx2", "scalar"]  # best first


@pytest.fixture(params=NATIVE_ISAS)
def isa(request):
    """Each native ISA path this CPU supports, forced for one test (the default path restored afterwards)."""
    from models import native

    if not native.available():
        pytest.skip(f"native library unavailable: {native.build_error()}")
    name = request.param
    if NATIVE_ISAS.index(name) < NATIVE_ISAS.index(native.best_isa()):
        pytest.skip(f"this CPU lacks {name}")
    native.set_isa(name)
    assert native.isa() == name
    yield name
    native.set_isa(None)


def offload_policies() -> list:
    """Every registered offload policy whose output is the model's (not speculative execution's: its own checks are in
    tests/test_speculation.py) as a test parameter; DALI (a 2026 baseline whose plans are checked step by
    step in tests/test_horizon.py) runs the whole-executor checks in the slow suite only, to keep the default
    suite's time."""
    from schedulers.base import OFFLOAD

    names = [name for name in OFFLOAD.names() if getattr(OFFLOAD.get(name).settings, "exact_output", True)]
    return [pytest.param(name, marks=pytest.mark.slow) if name == "dali" else name for name in names]


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ARG001 - pytest's hook signature
    """tests/test_native.py's explicit AMX-BF16 cases run in the slow suite (tests/test_native_quant.py checks the
    path against AVX512-BF16 in the default suite, and the default path is AMX where the CPU has it)."""
    for item in items:
        if item.nodeid.startswith("tests/test_native.py") and "[amx" in item.nodeid:
            item.add_marker(pytest.mark.slow)
