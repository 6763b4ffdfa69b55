"""Anonymous memory of `models.generate`'s compiled programs against depth, on truncated Qwen3-30B-A3B Q4_K_M files.

    python -m engine.bench.bench_program_memory --out /tmp/mem --layers 4 8 12
    python -m engine.bench.bench_program_memory --out /tmp/mem --layers 4 8 12 --per-expert   # experts as 3E arrays

The files are Qwen3-30B-A3B at its real width (128 experts of 768, hidden 2,048, 151,936-token vocabulary) cut to a
few layers (`engine.bench.full_depth_gguf` writes them: 1.9 / 3.5 / 5.0 GB for 4 / 8 / 12 layers), so that what
grows per layer can be told from what does not, without the 18.6-GB file. Each file runs in its own process: load,
then per batch size the generator's prefill and decode programs lowered and compiled one by one (RssAnon after each,
the heap trimmed, JAX's caches cleared: what the executable itself keeps), with XLA's `memory_analysis` (temporaries)
and the program's parameter count; then `Generator.generate` twice per batch size, as `models.generate` runs it.
`--per-expert` installs the experts as one array per expert and projection (the layout before the experts were
passed as each layer's three stacked tensors), for an A/B in one invocation: alternate the two on a loaded machine.
Printed: one row per file and batch size (MB), and the growth per layer between the shallowest and deepest file.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Optional


def _anon_mb() -> float:
    from models.memory import anon_bytes, release_free_heap

    gc.collect()
    release_free_heap()
    return (anon_bytes() or 0) / 1e6


def measure(path: Path, batches: list[int], per_expert: bool) -> dict:
    """In this process: load `path`, compile and run the generator's programs per batch size (module docstring)."""
    import jax
    import jax.numpy as jnp

    from models.generation import Generator, bucket
    from models.loading import load_model
    from models.transformer import init_cache

    out: dict = {"file": path.name, "per_expert": per_expert, "anon_start": _anon_mb()}
    t = time.perf_counter()
    cfg, model, _ = load_model({"checkpoint": str(path), "arch": None, "name": path.stem}, dtype=jnp.bfloat16)
    if per_expert:
        from models.gguf import block_experts, open_gguf
        from models.quant.experts import install

        install(model, block_experts(open_gguf(path)))
    out.update(layers=cfg.num_hidden_layers, load_s=time.perf_counter() - t, anon_loaded=_anon_mb())
    gen = Generator(model)
    out["parameters"] = len(jax.tree_util.tree_leaves(gen.state))
    key, params, P, new = jax.random.PRNGKey(0), jnp.zeros((2,), jnp.float32), 32, 17
    kept = []
    for B in batches:
        row: dict = {}
        cache = init_cache(model, B, bucket(P + new, gen.cache_bucket), gen.cache_dtype)
        lowerings = {
            "prefill": lambda: gen._prefill.lower(gen.state, cache, jnp.full((B, P), 7, jnp.int32), jnp.ones((B, P), bool),
                                                  key, params),
            "decode": lambda: gen._decode.lower(gen.state, cache, jnp.zeros((B,), jnp.int32), jnp.full((B,), P, jnp.int32),
                                                jnp.int32(3), jnp.int32(-1), jnp.int32(0), key, params, n_buffer=32)}
        for name, lower in lowerings.items():
            before = _anon_mb()
            t = time.perf_counter()
            compiled = lower().compile()
            row[f"{name}_compile_s"] = time.perf_counter() - t
            jax.clear_caches()
            row[f"{name}_kept_mb"] = _anon_mb() - before  # what the executable holds once compiled
            row[f"{name}_temp_mb"] = compiled.memory_analysis().temp_size_in_bytes / 1e6
            kept.append(compiled)
        out[f"b{B}"] = row
    kept.clear()
    jax.clear_caches()
    out["anon_before_generate"] = _anon_mb()
    for B in batches:
        for _ in range(2):
            gen.generate([list(range(5, 5 + P))] * B, new)
        out[f"b{B}"]["anon_after_generate"] = _anon_mb()
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the truncated files")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--per-expert", action="store_true", help="experts as one array per expert (the old layout)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this file in this process
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(measure(Path(a.one), a.batches, a.per_expert)), flush=True)
        return 0
    from engine.bench import full_depth_gguf as writer
    from engine.bench.bench_compile_depth import child_json

    rows = []
    print("| layers | layout | program parameters | load s | RssAnon after load | B | prefill kept | decode kept | "
          "prefill temp | decode temp | RssAnon after generate |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for layers in a.layers:
        path = writer.default_path(a.out, "qwen3_moe", "q4_k_m", layers)
        if not path.is_file():
            writer.write(writer.model_config("qwen3_moe", layers), "q4_k_m", path)
        cmd = [sys.executable, "-m", "engine.bench.bench_program_memory", "--out", a.out, "--one", str(path),
               "--batches", *map(str, a.batches)] + (["--per-expert"] if a.per_expert else [])
        r = child_json(cmd, layers)
        if r is None:
            continue
        rows.append(r)
        for B in a.batches:
            b = r[f"b{B}"]
            print(f"| {layers} | {'per expert' if a.per_expert else 'stacked'} | {r['parameters']} | {r['load_s']:.1f} | "
                  f"{r['anon_loaded']:.0f} | {B} | {b['prefill_kept_mb']:.0f} | {b['decode_kept_mb']:.0f} | "
                  f"{b['prefill_temp_mb']:.0f} | {b['decode_temp_mb']:.0f} | {b['anon_after_generate']:.0f} |", flush=True)
    if len(rows) >= 2:
        lo, hi = rows[0], rows[-1]
        span = hi["layers"] - lo["layers"]
        last = f"b{a.batches[-1]}"
        per_layer = {f"b{B} {p}": (hi[f"b{B}"][f"{p}_kept_mb"] - lo[f"b{B}"][f"{p}_kept_mb"]) / span
                     for B in a.batches for p in ("prefill", "decode")}
        grow = (hi[last]["anon_after_generate"] - hi["anon_loaded"] - lo[last]["anon_after_generate"]
                + lo["anon_loaded"]) / span
        print(f"\nkept per layer (MB): {json.dumps({k: round(v, 2) for k, v in per_layer.items()})}; "
              f"generate's growth per layer, all batch sizes: {grow:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
