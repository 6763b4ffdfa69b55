"""The page size of the model's host arrays follows `model.huge_pages` (models.memory.HostArrays)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from models.memory import HUGE_PAGE, HostArrays

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def smaps_entry(arr: np.ndarray) -> tuple[tuple[int, int], set[str]]:
    """The [start, end) addresses and VmFlags (hg: MADV_HUGEPAGE, nh: MADV_NOHUGEPAGE) of the mapping that
    holds `arr`'s first byte."""
    addr = arr.ctypes.data
    inside = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = (lo, hi) if lo <= addr < hi else None
            elif inside and line.startswith("VmFlags:"):
                return inside, set(line.split()[1:])
    raise AssertionError("no mapping holds the array")


def vm_flags(arr: np.ndarray) -> set[str]:
    return smaps_entry(arr)[1]


def mapping(arr: np.ndarray) -> tuple[int, int]:
    return smaps_entry(arr)[0]


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



def test_a_capacity_carves_every_array_from_one_mapping():
    """Reader threads populate slices of one mapping in parallel; a mapping per array serialises them."""
    wanted = [((3, 5), np.float32), ((HUGE_PAGE // 2 + 7,), np.uint16), ((11,), np.float32), ((HUGE_PAGE,), np.uint8)]
    arrays = HostArrays(capacity=HostArrays.footprint(wanted))
    got = [arrays.empty(shape, dtype) for shape, dtype in wanted]
    assert len({mapping(a) for a in got}) == 1
    for arr, (shape, dtype) in zip(got, wanted):
        assert arr.shape == shape and arr.dtype == dtype and arr.ctypes.data % 64 == 0
        if arr.nbytes >= HUGE_PAGE:
            assert arr.ctypes.data % 4096 == 0
        arr[...] = 1  # each slice is its own memory: writing one leaves the others alone
    assert all(int(a.reshape(-1)[0]) == 1 and a.size == int(np.prod(s)) for a, (s, _) in zip(got, wanted))
    ends = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in got)
    assert all(prev_end <= start for (_, prev_end), (start, _) in zip(ends, ends[1:]))
    beyond = arrays.empty((HUGE_PAGE,), np.uint8)  # past the capacity: a mapping of its own
    assert mapping(beyond) != mapping(got[0])
