"""Compile time against depth: `models.generate`'s first call on Qwen3-30B-A3B-shaped Q4_K_M files of 2..48 layers.

    python -m engine.bench.bench_compile_depth --out /tmp/fulldepth/scale --layers 2 4 8 16 48
    python -m engine.bench.bench_compile_depth --out /tmp/fulldepth/scale --layers 2 4 8 --unrolled   # layers not shared

The files keep the real model's structure (128 experts, top-8, Q4_K_M's per-layer types, GQA with qk-norm) at narrow
widths (hidden 512, expert width 256, vocabulary 8,192), so that the program has the real one's shape and the files
are small (`engine.bench.full_depth_gguf` writes them). Each depth runs in its own process: load, then one
`Generator.generate` of 4 tokens at batch 1 (trace + lower + compile + run), then a second (run only). Printed per
depth: JAX's own stage times (jaxpr trace, lowering to MLIR, XLA backend compile, summed over the programs). With
`--unrolled` the layers are traced one by one (`InMemoryExperts.layer_free` off), as before layers were shared.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

NARROW = dict(hidden_size=512, moe_intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
              vocab_size=8192, bos_token_id=1, eos_token_id=2, intermediate_size=512)


def narrow_file(out: Path, layers: int) -> Path:
    """The narrow Q4_K_M file of `layers` layers in `out` (written when missing)."""
    from engine.bench import full_depth_gguf as writer

    path = out / f"qwen3_moe-narrow-L{layers}.gguf"
    if not path.is_file():
        writer.write(writer.model_config("qwen3_moe", layers, **NARROW), "q4_k_m", path, drop_cache=False)
    return path


def measure(path: Path, unrolled: bool) -> dict:
    """In this process: load `path`, time two generate calls and JAX's stage times of the first."""
    import jax
    import jax.monitoring

    from models import moe
    from models.generation import Generator
    from models.loading import load_model

    if unrolled:
        moe.InMemoryExperts.layer_free = False
    stages: dict[str, float] = collections.defaultdict(float)
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: stages.__setitem__(event.rsplit("/", 1)[-1], stages[event.rsplit("/", 1)[-1]] + seconds))
    t0 = time.perf_counter()
    cfg, model, _ = load_model({"checkpoint": str(path), "arch": None, "name": path.stem}, dtype=jax.numpy.bfloat16)
    t1 = time.perf_counter()
    gen = Generator(model)
    prompts = [list(range(5, 21))]
    first = gen.generate(prompts, 4)
    t2 = time.perf_counter()
    second = gen.generate(prompts, 4)
    t3 = time.perf_counter()
    keep = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
    return {"layers": cfg.num_hidden_layers, "unrolled": unrolled, "load_s": t1 - t0, "first_call_s": t2 - t1,
            "second_call_s": t3 - t2, **{k: stages.get(k, 0.0) for k in keep},
            "tokens": first.tokens[0].tolist(), "same_tokens": bool((first.tokens == second.tokens).all())}


def child_json(cmd: list[str], layers: int) -> Optional[dict]:
    """Run a `--one` child; its last JSON line, or None after printing a table row that names the failure."""
    run = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode or not lines:
        print(f"| {layers} | failed (rc {run.returncode}): {run.stderr.strip().splitlines()[-1:]} |")
        return None
    return json.loads(lines[-1])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the narrow files")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 48])
    ap.add_argument("--unrolled", action="store_true", help="trace every layer (layer sharing off)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this file in this process
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(measure(Path(a.one), a.unrolled)), flush=True)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print("| layers | trace s | lower s | XLA compile s | first call s | second call s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for layers in a.layers:
        cmd = [sys.executable, "-m", "engine.bench.bench_compile_depth", "--out", a.out, "--one",
               str(narrow_file(out, layers))] + (["--unrolled"] if a.unrolled else [])
        r = child_json(cmd, layers)
        if r is None:
            continue
        print(f"| {layers} | {r['jaxpr_trace_duration']:.1f} | {r['jaxpr_to_mlir_module_duration']:.1f} | "
              f"{r['backend_compile_duration']:.1f} | {r['first_call_s']:.1f} | {r['second_call_s']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
