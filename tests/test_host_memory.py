"""The page size of the model's host arrays follows `model.huge_pages` (models.memory.HostArrays)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from models.memory import HUGE_PAGE, HostArrays

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def vm_flags(arr: np.ndarray) -> set[str]:
    """The VmFlags of the mapping that holds `arr`'s first byte (hg: MADV_HUGEPAGE, nh: MADV_NOHUGEPAGE)."""
    addr = arr.ctypes.data
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError("no mapping holds the array")


def test_huge_pages_only_when_asked():
    shape = (HUGE_PAGE // 4 * 3,)  # 6 MiB of float32
    huge = HostArrays(huge=True).empty(shape, np.float32)
    plain = HostArrays().empty(shape, np.float32)
    assert "hg" in vm_flags(huge) and "nh" not in vm_flags(huge)
    assert "nh" in vm_flags(plain) and "hg" not in vm_flags(plain)
    for arr in (huge, plain):
        assert arr.ctypes.data % 64 == 0 and arr.flags.writeable and arr.shape == shape


def test_small_arrays_are_aligned_ordinary_allocations():
    small = HostArrays(huge=True).empty((7, 3), np.float32)
    assert small.ctypes.data % 64 == 0 and small.shape == (7, 3)


@pytest.mark.parametrize("huge", [False, True])
def test_the_model_spec_reaches_the_loader(tmp_path, huge):
    """`model.huge_pages` decides the pages of the in-memory model's large weights (a 4 MiB embedding here)."""
    import jax.numpy as jnp
    from omegaconf import OmegaConf

    from core.config import resolve_path
    from models.hf import save_hf
    from models.loading import load_model, resolve_model_config
    from models.transformer import build_model

    arch = OmegaConf.load(resolve_path("pkg:conf/model/tiny_mixtral.yaml")).arch
    arch.vocab_size, arch.num_hidden_layers = 16384, 1
    cfg = resolve_model_config({"name": "wide-vocab", "arch": arch})
    save_hf(cfg, build_model(cfg, seed=0, dtype=jnp.float32), tmp_path)
    _, model, _ = load_model({"name": "wide-vocab", "checkpoint": str(tmp_path), "huge_pages": huge}, dtype="float32")
    table = np.asarray(model.embed[...])
    assert table.nbytes >= HUGE_PAGE
    assert ("hg" if huge else "nh") in vm_flags(table)
