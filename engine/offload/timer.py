"""The Timer of LayerScope §4.1: measured per-operation costs, fed back into the cost model online.

Samples are taken in windows (one forward pass, the hot-table preload): a window during which JAX
traced or compiled anything is dropped whole. A first call of a new shape compiles for hundreds of
milliseconds while the other threads' transfers and CPU experts run beside it, and those samples
would tell the cost model the machine is many times slower than it is (an on-demand load then looks
cheaper than a CPU expert, and the scheduler starts moving weights it should not).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator, Optional

import jax
import numpy as np

from schedulers.cost import CostModel

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")
_compiles = 0


def _count_compiles(event: str, duration: float, **kwargs: object) -> None:
    global _compiles
    if event in _COMPILE_EVENTS:
        _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def compile_count() -> int:
    """Traces and compilations JAX has done in this process so far."""
    return _compiles


# sample name -> the CostModel method it feeds (args: the sample's own, seconds last)
_UPDATES = {"transfer_s": "update_transfer", "cpu_s_per_expert": "update_cpu", "gpu_s_per_expert": "update_gpu",
            "cpu_dispatch_s": "update_cpu_dispatch", "layer_overhead_s": "update_layer_overhead",
            "pass_overhead_s": "update_pass_overhead"}


class Timer:
    """Collects measured transfer / CPU-expert / GPU-expert times and updates `cost` with each."""

    def __init__(self, cost: CostModel, expert_bytes: int, update_cost: bool = True):
        self.cost = cost
        self.expert_bytes = expert_bytes
        self.update_cost = update_cost
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.dropped = 0  # samples of windows that compiled
        self._lock = threading.Lock()
        self._pending: Optional[list[tuple[str, tuple]]] = None

    @contextmanager
    def window(self) -> Iterator[None]:
        """Hold the samples taken inside; apply them at the end unless JAX compiled meanwhile."""
        with self._lock:
            self._pending, start = [], compile_count()
        try:
            yield
        finally:
            with self._lock:
                pending, self._pending = self._pending or [], None
                if compile_count() != start:
                    self.dropped += len(pending)
                else:
                    for name, args in pending:
                        self._apply(name, args)

    def _add(self, name: str, *args: float) -> None:
        with self._lock:
            if self._pending is not None:
                self._pending.append((name, args))
            else:
                self._apply(name, args)

    def _apply(self, name: str, args: tuple) -> None:
        self.samples[name].append(args[-1])
        if name == "cpu_s_per_expert":
            self.samples["cpu_tokens"].append(float(args[0]))
        if self.update_cost:
            getattr(self.cost, _UPDATES[name])(*args)

    def transfer(self, seconds: float) -> None:
        self._add("transfer_s", seconds)

    def cpu(self, tokens: int, seconds: float) -> None:
        self._add("cpu_s_per_expert", tokens, seconds)

    def gpu(self, tokens: int, seconds: float) -> None:
        self._add("gpu_s_per_expert", tokens, seconds)

    def cpu_dispatch(self, seconds: float) -> None:
        """A layer's CPU side: wall time from hand-over to merged result minus its experts' compute."""
        self._add("cpu_dispatch_s", seconds)

    def layer_overhead(self, seconds: float) -> None:
        """Fixed host time of one MoE layer: its wall time up to the issued plan minus the modelled attention."""
        self._add("layer_overhead_s", seconds)

    def pass_overhead(self, seconds: float) -> None:
        """Fixed host time of one forward pass outside its MoE layers minus the modelled dense layers and head."""
        self._add("pass_overhead_s", seconds)

    def summary(self) -> dict[str, float]:
        """Medians in milliseconds and the achieved transfer bandwidth."""
        out: dict[str, float] = {}
        with self._lock:
            for name, values in self.samples.items():
                if name.endswith("_s") or name.endswith("_per_expert"):
                    stem = name[:-2] if name.endswith("_s") else name.replace("_s_", "_")
                    out[f"{stem}_median_ms"] = float(np.median(values)) * 1e3
                    out[f"{stem}_count"] = len(values)
            if self.samples.get("transfer_s"):
                out["transfer_gbps"] = self.expert_bytes / float(np.median(self.samples["transfer_s"])) / 1e9
            out["dropped_compiling_samples"] = self.dropped
        return out
