"""LLaPor's online learning trigger (LayerScope §4.2.3), per target layer.

The error of every forecast token (1 - its top-k hit fraction) enters a sliding window of the last
`window` tokens; its runtime data (gate input, source routing, true target experts) enters a
buffer of the last `buffer` tokens. When the window is full and its mean error exceeds `threshold`,
a fine-tuning cycle runs on the buffer and the window starts over (the next cycle needs a full
window of fresh evidence).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np

from predictors.config import OnlineSpec


def token_errors(predicted: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """float64 [T]: 1 - (true experts of the token that were forecast) / k. predicted [T, k'], actual [T, k]."""
    if actual.shape[0] == 0:
        return np.zeros(0)
    hits = (actual[:, :, None] == predicted[:, None, :]).any(axis=2).sum(axis=1)
    return 1.0 - hits / actual.shape[1]


class OnlineMonitor:
    """Error window and runtime-data buffer of one target layer."""

    def __init__(self, spec: OnlineSpec, feature_dims: tuple[int, ...]):
        if spec.window < 1 or spec.buffer < 1:
            raise ValueError(f"llapor.online: window and buffer must be >= 1, got {spec.window}, {spec.buffer}")
        if not 0.0 <= spec.threshold <= 1.0:
            raise ValueError(f"llapor.online.threshold: must lie in [0, 1], got {spec.threshold}")
        self.spec = spec
        self.errors: deque[float] = deque(maxlen=spec.window)
        self._buffers = [np.zeros((spec.buffer, d), np.float32) for d in feature_dims]
        self._filled = 0
        self._next = 0  # ring position of the next row
        self.cycles = 0

    @property
    def window_error(self) -> float:
        return float(np.mean(self.errors)) if self.errors else 0.0

    @property
    def buffered(self) -> int:
        return self._filled

    def push(self, errors: np.ndarray, *arrays: np.ndarray) -> bool:
        """Add T tokens (errors [T], one array [T, d] per feature); True when a fine-tuning cycle is due."""
        self.errors.extend(np.asarray(errors, np.float64).tolist())
        n = self.spec.buffer
        rows = [np.asarray(a, np.float32)[-n:] for a in arrays]  # only the last `buffer` tokens can survive
        t = rows[0].shape[0]
        idx = (self._next + np.arange(t)) % n
        for buf, a in zip(self._buffers, rows):
            buf[idx] = a
        self._next = int((self._next + t) % n)
        self._filled = min(n, self._filled + t)
        return len(self.errors) == self.spec.window and self.window_error > self.spec.threshold

    def batch(self) -> tuple[list[np.ndarray], np.ndarray]:
        """The buffered tokens, oldest first, padded to `buffer` rows, and their mask float32 [buffer]."""
        n = self.spec.buffer
        order = (self._next - self._filled + np.arange(self._filled)) % n
        out = []
        for buf in self._buffers:
            a = np.zeros_like(buf)
            a[: self._filled] = buf[order]
            out.append(a)
        mask = np.zeros(n, np.float32)
        mask[: self._filled] = 1.0
        return out, mask

    def start_over(self) -> None:
        """After a cycle: clear the error window (the buffer keeps sliding)."""
        self.errors.clear()
        self.cycles += 1
