"""The block kernels' weight prefetch level (`models.native.qprefetch`): chosen by CPU vendor at load (L1 on AMD,
L2 elsewhere: each measured faster where it is the default, see `kQPrefetch` in models/native/kernels.cc), overridable
by `MOESCOPE_NATIVE_QPREFETCH` and `set_qprefetch`, and never changing a result."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models import native

REPO = Path(__file__).resolve().parent.parent
LEVELS = ("l1", "l2", "off")

pytestmark = pytest.mark.skipif(not native.available(), reason="native library unavailable")


def cpu_vendor() -> str:
    """The x86 vendor string of /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@pytest.fixture
def restore_level():
    yield
    native.set_qprefetch(None)


def test_default_level_follows_the_cpu_vendor(restore_level, monkeypatch):
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_vendor():
        pytest.skip("not an x86 CPU with /proc/cpuinfo")
    monkeypatch.delenv("MOESCOPE_NATIVE_QPREFETCH", raising=False)
    native.set_qprefetch(None)
    assert native.qprefetch() == ("l1" if cpu_vendor() == "AuthenticAMD" else "l2")


def test_levels_give_identical_bits(restore_level):
    """Every block type, on every row count path (one pass over the weights at 1-8 rows, 4-row streams and 2-row
    streams, the tail of weight rows without prefetch, the chunked passes above 8 rows), bf16 and f32 inputs, 1 and 2
    threads: the same bits at each level."""
    if native.best_isa() not in ("amx", "avx512bf16"):
        pytest.skip("the level only reaches the AVX-512 block kernels")
    native.set_isa("avx512bf16")
    try:
        rng = np.random.default_rng(3)
        for qtype in native.QTYPE_IDS:
            w = native.random_blocks(rng, qtype, 203, 1024)  # 203 rows: a tail after the 4-row blocks
            for M in (1, 2, 3, 5, 8, 13):
                x = rng.standard_normal((M, 1024)).astype(np.float32)
                ys = {}
                for level in LEVELS:
                    native.set_qprefetch(level)
                    assert native.qprefetch() == level
                    ys[level] = [native.linear_host(x, w, threads=t) for t in (1, 2)]
                for level in LEVELS[1:]:
                    for a, b in zip(ys["l1"], ys[level]):
                        assert np.array_equal(a, b), (qtype, M, level)
                ref = native.qlinear_reference(x, w)  # and right, not merely alike
                assert np.allclose(ys["l1"][0], ref, rtol=1e-4, atol=1e-3 * np.abs(ref).max()), (qtype, M)
    finally:
        native.set_isa(None)


def test_environment_and_bad_names(restore_level, monkeypatch):
    env = {**os.environ, "MOESCOPE_NATIVE_QPREFETCH": "off"}
    out = subprocess.run([sys.executable, "-c", "from models import native; print(native.qprefetch())"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "off"
    monkeypatch.setenv("MOESCOPE_NATIVE_QPREFETCH", "l2")  # None goes back to the level the process started at
    native.set_qprefetch("off")
    native.set_qprefetch(None)
    assert native.qprefetch() == "l2"
    with pytest.raises(ValueError, match=r"^unknown prefetch level 't0' \(l1, l2, off\)$"):
        native.set_qprefetch("t0")
