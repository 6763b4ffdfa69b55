"""The hot-expert table (LayerScope §4.1 Counter): experts ranked by tokens processed in profiling
runs; the hottest are preloaded until the memory budget is full."""

from __future__ import annotations

import numpy as np


def rank_experts(profile_loads: np.ndarray) -> np.ndarray:
    """int [L*E, 2]: (layer, expert) pairs, hottest first (ties: lower layer, then lower expert id)."""
    L, E = profile_loads.shape
    flat = profile_loads.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))  # by tokens desc, then flat index asc
    return np.stack([order // E, order % E], axis=1)


def hot_table(profile_loads: np.ndarray, slots: int) -> np.ndarray:
    """bool [L, E]: the `slots` hottest experts of the whole model (global ranking)."""
    if profile_loads.ndim != 2:
        raise ValueError(f"hot_table: profile_loads must be [L, E], got shape {profile_loads.shape}")
    table = np.zeros(profile_loads.shape, dtype=bool)
    slots = int(max(0, min(slots, profile_loads.size)))
    if slots:
        pairs = rank_experts(profile_loads)[:slots]
        table[pairs[:, 0], pairs[:, 1]] = True
    return table


def per_layer_slots(num_layers: int, slots: int) -> np.ndarray:
    """int [L]: an even split of `slots` over the layers (the first layers take the remainder)."""
    base, extra = divmod(int(max(slots, 0)), num_layers)
    return np.array([base + (1 if layer < extra else 0) for layer in range(num_layers)], dtype=np.int64)


def per_layer_hot_table(profile_loads: np.ndarray, slots_per_layer: np.ndarray) -> np.ndarray:
    """bool [L, E]: in each layer its `slots_per_layer[l]` hottest experts (per-layer caches)."""
    L, E = profile_loads.shape
    table = np.zeros((L, E), dtype=bool)
    for layer in range(L):
        n = int(min(slots_per_layer[layer], E))
        if n:
            order = np.lexsort((np.arange(E), -profile_loads[layer]))
            table[layer, order[:n]] = True
    return table
