"""Principal component analysis of gate inputs (LayerScope §4.2.2: compress a before the predictor)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PCA:
    mean: np.ndarray  # float32 [H]
    components: np.ndarray  # float32 [H, p]: principal directions by decreasing variance (scaled to unit variance if whitened)
    explained: float  # share of the total variance the p components keep

    @property
    def dim(self) -> int:
        return int(self.components.shape[1])

    def transform(self, x: np.ndarray) -> np.ndarray:
        """x [T, H] -> [T, p]."""
        return ((x - self.mean) @ self.components).astype(np.float32)


def fit_pca(x: np.ndarray, dim: int, whiten: bool = False) -> PCA:
    """The top-`dim` principal directions of the rows of x [N, H] (eigenvectors of the covariance).

    `whiten`: scale each direction so that the projected training rows have unit variance.
    """
    x = np.asarray(x, np.float64)
    n, h = x.shape
    if not 1 <= dim <= h:
        raise ValueError(f"PCA: dim must lie in [1, {h}], got {dim}")
    if n < 2:
        raise ValueError(f"PCA: needs >= 2 rows, got {n}")
    mean = x.mean(axis=0)
    cov = np.cov(x - mean, rowvar=False)
    vals, vecs = np.linalg.eigh(cov)
    order = np.argsort(vals)[::-1]
    vals, vecs = np.clip(vals[order], 0.0, None), vecs[:, order]
    # a deterministic sign per component (largest-magnitude entry positive)
    signs = np.sign(vecs[np.abs(vecs).argmax(axis=0), np.arange(h)])
    vecs = vecs * np.where(signs == 0, 1.0, signs)
    total = vals.sum()
    comps = vecs[:, :dim]
    if whiten:
        comps = comps / np.sqrt(np.maximum(vals[:dim], 1e-12 * max(total, 1e-30)))
    return PCA(mean=mean.astype(np.float32), components=comps.astype(np.float32),
               explained=float(vals[:dim].sum() / total) if total > 0 else 1.0)


def pca_dim(hidden_size: int, ratio: float, min_dim: int) -> int:
    """ceil(ratio * hidden_size), at least `min_dim`, at most `hidden_size`."""
    if ratio <= 0:
        raise ValueError(f"pca_ratio must be > 0, got {ratio}")
    return int(min(hidden_size, max(min_dim, math.ceil(ratio * hidden_size))))
