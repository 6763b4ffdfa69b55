"""Host memory: what the machine has, whether a model fits before any weight is read, and the peak
anonymous memory a process reaches.

Anonymous memory is what a process allocated itself (model arrays, caches, runtime); pages of a
memory-mapped checkpoint are file-backed and not counted, since the kernel can drop and re-read them.
Linux keeps no high-water mark of anonymous memory, so `PeakMemory` samples it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from typing import Any, Iterable, Optional

import numpy as np

GIB = 2**30


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            rows = [line.split() for line in f]
    except OSError:
        return {}
    return {r[0].rstrip(":"): int(r[1]) * 1024 for r in rows if len(r) >= 2 and r[1].isdigit()}


def host_memory() -> tuple[Optional[int], Optional[int]]:
    """(total, available) host memory in bytes, or None where the system does not say."""
    info = _meminfo()
    return info.get("MemTotal"), info.get("MemAvailable")


def check_fits(need_bytes: int, what: str, hint: str, available: Optional[int] = None) -> None:
    """Raise MemoryError before any heavy work when `need_bytes` exceed the host's available memory."""
    if available is None:
        available = host_memory()[1]
    if available is not None and need_bytes > available:
        raise MemoryError(f"{what} needs {need_bytes / GIB:.1f} GiB of host memory, this machine has "
                          f"{available / GIB:.1f} GiB available; {hint}")


def anon_bytes() -> Optional[int]:
    """This process's resident anonymous memory now (RssAnon), or None where /proc has no such field."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """Samples this process's anonymous memory every `interval` seconds in a daemon thread; `peak` is the
    largest value seen (a spike shorter than the interval can be missed; a model's arrays cannot)."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak = anon_bytes() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moescope-peak-memory", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> int:
        now = anon_bytes() or 0
        self.peak = max(self.peak, now)
        return now

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        self.sample()


def memory_report(peak: PeakMemory, checkpoint_bytes: Optional[int]) -> dict[str, Any]:
    """The results entries every serving entry point reports about memory."""
    out: dict[str, Any] = {"peak_anon_bytes": int(peak.peak), "peak_anon_gib": peak.peak / GIB}
    if checkpoint_bytes:
        out["checkpoint_bytes"] = int(checkpoint_bytes)
        out["peak_anon_over_checkpoint"] = peak.peak / checkpoint_bytes
    return out


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ---- page size of the model's host arrays ----------------------------------------------------------------
# A weight streamed from 2 MiB pages reads a few per cent faster than from 4 KiB pages (fewer TLB misses). But
# first-touching fresh huge pages can cost far more than plain ones: the kernel may compact memory for them,
# and a virtual machine's host backs fresh guest memory on first touch. On the VM this project is measured on
# (`engine/bench/bench_real_width.py`) a checkpoint loaded into huge pages took several times as long as into
# plain pages, so plain pages are the default and huge pages a choice (`model.huge_pages=true`).

HUGE_PAGE = 2 << 20
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def populate(arr: np.ndarray) -> None:
    """Back `arr`'s pages with memory now, in one system call (as `MADV_POPULATE_WRITE`), rather than one page
    fault per 4 KiB page on first write: each fault is a trap, which a virtual machine makes dear. ctypes drops
    the GIL meanwhile, so another thread copies on. Where the kernel lacks it the pages fault in as usual."""
    if _libc is not None and arr.nbytes:
        _libc.madvise(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(arr.nbytes), _MADV_POPULATE_WRITE)


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc `malloc_trim`). Loading dequantizes tensor after
    tensor into temporaries below glibc's mmap threshold (which grows to 32 MiB as large blocks are freed); their
    freed pages otherwise stay in the process as anonymous memory: ~1 GB after the dense weights of a 4-layer
    Qwen3-30B-A3B-width Q4_K_M GGUF (3.9 -> 3.3 GB RssAnon)."""
    if _libc is not None and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(ctypes.c_size_t(0))


class HostArrays:
    """Allocates the model's host arrays: 64-byte aligned (so a jax CPU array can alias them), uninitialised;
    those of 2 MiB or more start on a page boundary, on huge pages when `huge`, plain 4 KiB pages otherwise.

    `capacity` bytes (see `footprint`) come from one anonymous mapping made up front, which `empty` carves:
    every separate mapping takes the process's memory-map lock for writing, so reader threads each mapping
    their own arrays wait for one another, where populating slices of one mapping runs in parallel. Arrays
    past the capacity get mappings of their own (small ones: ordinary allocations)."""

    def __init__(self, huge: bool = False, capacity: int = 0):
        self.huge = huge
        self._lock = threading.Lock()
        self._arena = self._map(capacity) if capacity > 0 else None
        self._used = 0

    def _page(self, nbytes: int) -> int:
        """The alignment of an array of `nbytes`."""
        if nbytes < HUGE_PAGE:
            return 64
        return HUGE_PAGE if self.huge else mmap.PAGESIZE

    @staticmethod
    def footprint(arrays: Iterable[tuple[tuple[int, ...], Any]], huge: bool = False) -> int:
        """Arena bytes that hold arrays of these (shape, dtype), aligned as `empty` aligns them."""
        probe = HostArrays(huge)
        total = 0
        for shape, dtype in arrays:
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            total += -total % probe._page(nbytes) + nbytes
        return total

    def _map(self, nbytes: int) -> np.ndarray:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
            region.madvise(mmap.MADV_HUGEPAGE if self.huge else mmap.MADV_NOHUGEPAGE)
        return np.frombuffer(region, dtype=np.uint8)

    def _carve(self, nbytes: int) -> Optional[np.ndarray]:
        """`nbytes` of the arena, aligned for their size; None when it has no room left."""
        if self._arena is None:
            return None
        with self._lock:
            start = self._used + (-self._used % self._page(nbytes))
            if start + nbytes > self._arena.size:
                return None
            self._used = start + nbytes
        return self._arena[start:start + nbytes]

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised array of `shape` and `dtype`, its pages already backed by memory."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        raw = self._carve(nbytes)
        if raw is None and nbytes < HUGE_PAGE:
            raw = np.empty(nbytes + 64, np.uint8)
            raw = raw[(-raw.ctypes.data) % 64:][:nbytes]
        elif raw is None:
            raw = self._map(nbytes)
        arr = raw.view(dtype).reshape(shape)
        if nbytes >= HUGE_PAGE:
            populate(arr)
        return arr
