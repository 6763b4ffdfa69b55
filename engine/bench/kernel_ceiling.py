"""How fast XLA:CPU's own dot kernels let a decode step of a Mixtral-shaped model run on this machine.

A decode step's expert work is dots over weights it reads once: a batch-1 step is matrix-vector products
(k experts per MoE layer), a batch-16 step small-M matrix products (every expert of a layer, a few rows
each). This measures, on distinct weights of the model's expert shape (more than the L3 cache holds, as a
decode step meets them), the rate at which XLA streams expert weights at a given number of rows, next to
what the machine's memory delivers to torch with one and with every thread, and turns the rates into
floors for the step: the bytes a step must read over the rate its kernels reach.
`python -m engine.bench.bench_decode --ceiling` prints them next to the measured figures.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.layers import swiglu
from models.moe import default_chunk
from schedulers.cost import non_expert_params

SWEEP_BYTES = 256 * 2**20  # the host read-rate array: far beyond any cache here


@dataclass(frozen=True)
class Ceiling:
    """Rates (GB/s of weights) and the step floors they give, all from one measurement."""

    torch_read_gbps_one_thread: float
    torch_read_gbps_all_threads: float
    xla_gbps_by_rows: dict[int, float]  # rows per expert call -> expert weights streamed per second
    b1_bytes: int  # weights a batch-1 step reads: k experts per MoE layer and the dense weights
    b1_floor_ms: float  # b1_bytes at XLA's one-row rate
    batch: int  # the larger decode batch
    batch_rows: int  # its pairs per expert, rounded up: the fewest rows an expert call can have
    batch_expert_floor_ms: float  # every expert of every MoE layer at that row count: the experts alone


def torch_read_gbps(threads: int, repeats: int = 5) -> float:
    """The machine's memory read rate through torch's sum over `threads` threads (best of `repeats`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(SWEEP_BYTES // 4)
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - t)
        return SWEEP_BYTES / best / 1e9
    finally:
        torch.set_num_threads(before)


def expert_stream_gbps(hidden: int, intermediate: int, layers: int, per_layer: int, rows: int, sets: int,
                       repeats: int = 10, seed: int = 0) -> float:
    """Expert weight bytes per second of one jitted program that runs, layer after layer, `per_layer`
    independent SwiGLU experts (gate_up [2*intermediate, hidden], down [hidden, intermediate]) on `rows`
    rows each. `sets` distinct weight sets are used in turn, so the weights come from memory as in decode."""
    rng = np.random.default_rng(seed)

    def weights() -> list[list[tuple[jax.Array, jax.Array]]]:
        return [[(jnp.asarray(rng.standard_normal((2 * intermediate, hidden), np.float32) * 0.05),
                  jnp.asarray(rng.standard_normal((hidden, intermediate), np.float32) * 0.05))
                 for _ in range(per_layer)] for _ in range(layers)]

    @jax.jit
    def step(x: jax.Array, w: list) -> jax.Array:
        for layer in w:
            x = x + sum(swiglu(x, gu, dn) for gu, dn in layer) * 1e-3
        return x

    all_sets = [weights() for _ in range(sets)]
    x = jnp.asarray(rng.standard_normal((rows, hidden), np.float32))
    step(x, all_sets[0]).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        for w in all_sets:
            step(x, w).block_until_ready()
        best = min(best, (time.perf_counter() - t) / sets)
    return layers * per_layer * 3 * hidden * intermediate * 4 / best / 1e9


def measure(cfg: ModelConfig, batch: int = 16, repeats: int = 10) -> Ceiling:
    """The rates on this machine and the floors of `cfg`'s fp32 decode steps at batch 1 and `batch`."""
    L, E, k = len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok
    H, inter = cfg.hidden_size, cfg.expert_intermediate_size
    expert_bytes = cfg.expert_bytes(4)
    batch_rows = math.ceil(batch * k / E)
    # batch 1: k experts per layer, sets enough to read the whole expert store between reuses
    rates = {1: expert_stream_gbps(H, inter, L, k, 1, sets=max(E // k, 1), repeats=repeats)}
    for rows in sorted({batch_rows, default_chunk(batch * k, E)}):  # exact, and the rows the engine runs
        rates[rows] = expert_stream_gbps(H, inter, L, E, rows, sets=1, repeats=repeats)
    # a decode row reads one embedding row, not the table
    dense = (non_expert_params(cfg) - cfg.vocab_size * H) * 4
    b1_bytes = L * k * expert_bytes + dense
    return Ceiling(torch_read_gbps(1), torch_read_gbps(os.cpu_count() or 1), rates, b1_bytes,
                   1e3 * b1_bytes / (rates[1] * 1e9), batch, batch_rows,
                   1e3 * L * E * expert_bytes / (rates[batch_rows] * 1e9))
