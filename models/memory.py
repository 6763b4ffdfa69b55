"""Host memory: what the machine has, whether a model fits before any weight is read, and the peak
anonymous memory a process reaches.

Anonymous memory is what a process allocated itself (model arrays, caches, runtime); pages of a
memory-mapped checkpoint are file-backed and not counted, since the kernel can drop and re-read them.
Linux keeps no high-water mark of anonymous memory, so `PeakMemory` samples it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

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
