"""What every peer shares: the benchmark prompts, and peak memory sampled from /proc/self/status.

Standard library and numpy only (the peers run in venvs without the project's dependencies). RssAnon is the
memory the process allocated itself (weights copied into its heap, caches, activations); RssFile is
mapped file pages it touched (mmapped checkpoints); VmHWM is the kernel's own peak of their sum.
"""

from __future__ import annotations

import threading
import time

import numpy as np

_FIELDS = ("RssAnon", "RssFile", "VmRSS", "VmHWM")


def prompt_ids(batch: int, length: int, vocab: int, seed: int = 1) -> np.ndarray:
    """The benchmark prompts every system gets: [batch, length] ids in [3, min(vocab, 4096)), inside the
    shipped tokenizer's vocabulary."""
    return np.random.default_rng(seed).integers(3, min(vocab, 4096), (batch, length))


def status() -> dict[str, int]:
    """The fields above in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in _FIELDS:
                out[key] = int(rest.split()[0]) * 1024
    return out


class MemWatch:
    """Samples every `interval` s from `start()` to `stop()`; `peaks()` gives the maxima (bytes)."""

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.peak = {k: 0 for k in _FIELDS}
        self.baseline = status()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memwatch", daemon=True)

    def _sample(self) -> None:
        for k, v in status().items():
            if v > self.peak[k]:
                self.peak[k] = v

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def start(self) -> "MemWatch":
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peaks()

    def peaks(self) -> dict[str, int]:
        return {"peak_anon_bytes": self.peak["RssAnon"], "peak_file_bytes": self.peak["RssFile"],
                "peak_rss_bytes": self.peak["VmRSS"], "vm_hwm_bytes": self.peak["VmHWM"],
                "baseline_anon_bytes": self.baseline.get("RssAnon", 0)}
