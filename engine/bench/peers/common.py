"""What every peer shares: the benchmark prompts, and peak memory sampled from /proc/self/status.

Standard library and numpy only (the peers run in venvs without the project's dependencies). RssAnon is the
memory the process allocated itself (weights copied into its heap, caches, activations); RssFile is
mapped file pages it touched (mmapped checkpoints); VmHWM is the kernel's own peak of their sum.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

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


def time_batch(system: str, generate: Callable[[np.ndarray, int], dict[str, Any]], prompts: np.ndarray, new: int,
               repeats: int) -> dict[str, Any]:
    """Decode speed of one batch: a warm-up, then `repeats` timed runs of `generate(prompts, new)` (which returns
    per-step seconds `step_s`, `prefill_s` and `tokens`); the best run is reported, the median beside it."""
    generate(prompts, 2)  # warm-up
    runs = [generate(prompts, new) for _ in range(repeats)]
    rates = [len(prompts) * new / sum(r["step_s"]) for r in runs]
    run = runs[int(np.argmax(rates))]
    dt = sum(run["step_s"])
    print(f"{system} batch {len(prompts)}: {max(rates):.2f} tok/s decode, best of {repeats} "
          f"(median {np.median(rates):.2f}; {1e3 * dt / new:.0f} ms/step), prefill {run['prefill_s']:.2f} s",
          flush=True)
    return {"decode_tok_s": max(rates), "decode_tok_s_median": float(np.median(rates)), "decode_tok_s_runs": rates,
            "decode_s": dt, "prefill_s": run["prefill_s"], "step_ms_median": 1e3 * float(np.median(run["step_s"])),
            "first_tokens": run["tokens"][0][:8]}


def finish(result: dict[str, Any], watch: MemWatch, out: Optional[str]) -> int:
    """Adds the memory peaks, writes the result to `out` (when given) and prints it."""
    result.update(watch.stop())
    text = json.dumps(result, indent=2)
    if out:
        Path(out).write_text(text + "\n")
    print(text)
    return 0
