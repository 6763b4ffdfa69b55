"""Where an expert "transfer" spends its time on this backend: the AsyncIO link against a host memory copy.

    python -m engine.bench.bench_transfer                    # Mixtral-8x7B width: one 336-MiB bf16 expert
    python -m engine.bench.bench_transfer --family qwen3_moe --rounds 5

The source is what an offloaded run's store holds: bf16 views of a memory-mapped file (written once under
--dir, deleted at the end). Measured in one process, alternated round by round, each the best of the rounds:
`memcpy` (numpy copy of the expert's three projections into host buffers: the host's own copy rate),
`device_put` (jax.device_put of the views: zero-copy on the CPU backend, a DMA from pinned memory on a GPU),
`slot write, bf16 update` (the cache's in-place jitted update of a donated slot, as it was: XLA's
dynamic_update_slice on bf16), `slot write, as uint16` (the same bytes as unsigned integers: what
`DeviceExpertCache` does now), and `link` (a whole transfer through `TransferLink`, what the Timer reports).
Every path reads pages already in memory (first touches happen in the warm-up round): a cold read of a
checkpoint from disk is not measured here. Prints GB/s and each path's ratio to memcpy.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from engine.bench.real_width import real_width_config
from engine.offload.cache import DeviceExpertCache
from engine.offload.link import Job, TransferLink
from engine.offload.store import PARTS, ExpertStore


def mapped_store(cfg, path: Path) -> ExpertStore:
    """Every expert of `cfg`'s first MoE layer as views of one random bf16 expert in a mapped file at `path`."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    H, F = cfg.hidden_size, cfg.expert_intermediate_size
    if not path.is_file():
        values = (np.random.default_rng(0).standard_normal(3 * F * H, np.float32) * 0.02).astype(bf16)
        values.tofile(path)
    mapped = np.memmap(path, dtype=bf16, mode="r")
    store = ExpertStore(cfg, bf16, pinned=False)
    gate, up, down = mapped[:F * H].reshape(F, H), mapped[F * H:2 * F * H].reshape(F, H), mapped[2 * F * H:].reshape(H, F)
    for layer in range(len(cfg.moe_layers)):
        for expert in range(cfg.num_experts):
            store.put(layer, expert, gate, up, down)
    return store


def plain_update(dst: jax.Array, block: jax.Array, at: jax.Array) -> jax.Array:
    """The slot write as it was: a bf16 dynamic_update_slice."""
    return jax.lax.dynamic_update_slice(dst, block, (at, jnp.int32(0)))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: Optional[list[str]] = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="mixtral")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    a = ap.parse_args(argv)
    cfg = real_width_config(a.family, num_layers=1)
    path = a.dir / f"moescope_bench_transfer_{a.family}.bin"
    try:
        store = mapped_store(cfg, path)
        cache = DeviceExpertCache(cfg, 1, 1, jnp.bfloat16)
        link = TransferLink(store, cache, 1)
        plain = jax.jit(plain_update, donate_argnums=0)
        parts = [store.part(0, 0, p) for p in PARTS]
        hosts = [np.empty_like(p) for p in parts]
        blocks = [jax.device_put(p, cache.sharding) for p in parts]
        F = cfg.expert_intermediate_size

        def memcpy() -> None:
            for dst, src in zip(hosts, parts):
                np.copyto(dst, src)

        def device_put() -> None:
            jax.block_until_ready([jax.device_put(p, cache.sharding) for p in parts])

        def slot_write(update: Callable) -> Callable[[], None]:
            def run() -> None:
                for part, block in zip(PARTS, blocks):
                    target = cache.down if part == "down" else cache.gate_up
                    target[0] = update(target[0], block, np.int32(F if part == "up" else 0))
                jax.block_until_ready([cache.gate_up[0], cache.down[0]])
            return run

        def through_link() -> None:
            slot = cache.reserve(0, 0, staging=False)
            link.submit([Job(0, 0, slot, retain=True, prefetch=False)])
            link.wait(0, 0)
            cache.release(slot)

        paths = {"memcpy": memcpy, "device_put": device_put, "slot write, bf16 update": slot_write(plain),
                 "slot write, as uint16": slot_write(cache._write_block), "link": through_link}
        for fn in paths.values():  # compiles and first touches
            fn()
        best = {name: min(timed(fn) for _ in range(1)) for name, fn in paths.items()}
        for _ in range(a.rounds - 1):  # alternated: load on the machine hits every path alike
            for name, fn in paths.items():
                best[name] = min(best[name], timed(fn))
        link.close()
    finally:
        path.unlink(missing_ok=True)
    nbytes = store.expert_bytes
    rates = {name: nbytes / s / 1e9 for name, s in best.items()}
    print(f"one {a.family} expert ({nbytes / 2**20:.0f} MiB bf16) on {jax.devices()[0].platform}, best of {a.rounds}:")
    for name, gbps in rates.items():
        print(f"  {name:<26}{gbps:8.2f} GB/s  {gbps / rates['memcpy']:5.2f}x memcpy")
    return rates


if __name__ == "__main__":
    main()
