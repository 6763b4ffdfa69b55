"""Real routing for the simulator: a trained model serves the replayed Azure requests and its
router decisions (and gate inputs) are recorded.

MoEless §6.1 samples request text from a prompt dataset and replays the Azure arrivals and token
counts. Here a checkpoint with a trained router (e.g. the shipped mixtral-tiny, 8 experts top-2)
serves each per-second batch: the prompts are ShareGPT text cut to each request's exact
`ContextTokens` (`engine.workloads.TraceReplay`), and every request decodes exactly its
`GeneratedTokens` (greedy, no EOS stop). The trace keeps the routing of every prefill and decode
token, so expert loads vary with the content as they do in production, and each token's gate input
per MoE layer, so a gate-copy predictor (MoEless §4.1) can run on the replay. A paper-scale model
with the same expert count and top-k is then simulated on it, its MoE layers cycling through the
recorded ones (`engine.sim.routing.tile_layers`).

Context caps: Azure conversation prompts reach ~5k tokens, more than a small trained model's
position table (1,024 for mixtral-tiny). `context_caps` derives per-request caps from the model's
`max_position_embeddings` (outputs keep at most a quarter of the positions, prompts the rest), and
the serve entry point applies them to the workload, so every system is simulated on the capped
lengths; results.json reports the caps and the tokens they removed.

Recordings are cached under `runs/routing_cache/<key>/`, the key a hash of everything the
recording depends on (checkpoint bytes, the workload config, batch limit, seed, format version), so
a second run with the same inputs replays the recording instead of serving the requests again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from core.config import REPO_ROOT, resolve_path
from core.trace import RoutingTrace, TraceRecorder

CACHE_DIR = REPO_ROOT / "runs" / "routing_cache"
CACHE_VERSION = 1  # bump when the recording changes (what is recorded, how prompts are built)
OUTPUT_SHARE = 4  # outputs keep at most 1/OUTPUT_SHARE of the positions when requests must be capped


def context_caps(max_positions: int, max_context: Optional[int] = None, max_generated: Optional[int] = None
                 ) -> tuple[int, int]:
    """(prompt cap, output cap) with prompt + output <= `max_positions` for every request.

    The output keeps min(its configured cap, max_positions // 4) positions (Azure conversation
    outputs: median 88, p90 396 tokens on the 30-s peak, so 256 of 1,024 keeps most untouched), the
    prompt the rest (and no more than its configured cap).
    """
    if max_positions < 2:
        raise ValueError(f"context caps: the model has {max_positions} positions, need >= 2")
    gen = max(1, max_positions // OUTPUT_SHARE)
    if max_generated is not None:
        gen = min(gen, max_generated)
    ctx = max_positions - gen
    if max_context is not None:
        ctx = min(ctx, max_context)
    return ctx, gen


def checkpoint_positions(checkpoint: str) -> int:
    """`max_position_embeddings` of the HF checkpoint folder `checkpoint` (pkg: paths allowed)."""
    folder = resolve_path(checkpoint)
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"routing_checkpoint: {checkpoint} has no config.json (an HF checkpoint folder is needed)")
    return int(json.loads(config.read_text())["max_position_embeddings"])


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_key(checkpoint: str, workload: Any, max_batches: Optional[int], seed: int) -> str:
    """Hash of every input of a recording: the checkpoint's files, the workload config, the batch
    limit, the seed and the recording's format version."""
    from omegaconf import OmegaConf

    folder = resolve_path(checkpoint)
    files = {p.name: _file_digest(p) for p in sorted(folder.iterdir())
             if p.is_file() and p.suffix in (".json", ".safetensors")}
    if dataclasses.is_dataclass(workload):
        wl = json.loads(json.dumps(dataclasses.asdict(workload), default=lambda o: getattr(o, "value", str(o))))
    else:
        wl = OmegaConf.to_container(workload, resolve=True) if OmegaConf.is_config(workload) else workload
    blob = json.dumps({"files": files, "workload": wl, "max_batches": max_batches, "seed": seed,
                       "version": CACHE_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def record_replay_routing(checkpoint: str, workload: Any, max_batches: int | None = None, seed: int = 0,
                          progress: Callable = lambda it, desc: it, capture_hidden: bool = True
                          ) -> tuple[RoutingTrace, np.ndarray]:
    """Serve the Azure replay of `workload` (an azure `WorkloadConfig`) with the model at `checkpoint`.

    Returns the routing trace (one batch per non-empty interval, prefill then decode steps; gate
    inputs per MoE layer when `capture_hidden`) and the start time (s) of each recorded batch.
    """
    from engine.recording import record_generation, trace_meta
    from engine.workloads.build import build_workload
    from models.generation import Generator
    from models.loading import load_model, load_tokenizer

    spec = {"name": str(checkpoint).rstrip("/").split("/")[-1], "checkpoint": checkpoint}
    cfg, model, folder = load_model(spec, seed=seed)
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        raise ValueError(f"routing_checkpoint: {checkpoint} has no tokenizer.json (a trained model with its "
                         "tokenizer is needed to serve the replayed prompt text)")
    replay = build_workload(workload, tokenizer, separator_id=cfg.eos_token_id)
    batches = [b for b in replay if b.num_requests > 0]
    if max_batches is not None:
        batches = batches[:max_batches]
    longest = max(len(t) + int(g) for b in batches for t, g in zip(b.tokens, b.gen_lens))
    if longest > cfg.max_position_embeddings:
        raise ValueError(f"routing_checkpoint: requests need {longest} positions, the model has "
                         f"{cfg.max_position_embeddings}; cap workload.azure.max_context_tokens / max_generated_tokens "
                         "(engine.serve derives the caps itself: model_routing.context_caps)")
    recorder = TraceRecorder(trace_meta(cfg, spec["name"], f"azure replay: {workload.name}"), keep_hidden=capture_hidden)
    # coarse prompt / cache buckets: every per-second batch has other lengths, and each new shape compiles
    generator = Generator(model, capture=True, capture_hidden=capture_hidden, prompt_bucket=128, cache_bucket=256)
    starts, first = [], 0
    for b in progress(batches, "record routing"):
        prompts = [list(t) for t in b.tokens]
        gen = np.maximum(b.gen_lens.astype(np.int64), 1)
        out = generator.generate(prompts, int(gen.max()), pad_token_id=cfg.pad_token_id)
        record_generation(recorder, dataclasses.replace(out, lengths=gen), prompts, range(first, first + len(prompts)))
        starts.append(b.start_s)
        first += len(prompts)
    return recorder.build(), np.asarray(starts, dtype=np.float64)


def cached_replay_routing(checkpoint: str, workload: Any, max_batches: int | None = None, seed: int = 0,
                          progress: Callable = lambda it, desc: it, cache_dir: Optional[Path | str] = "default",
                          with_hidden: bool = True) -> tuple[RoutingTrace, np.ndarray, dict[str, Any]]:
    """`record_replay_routing` (gate inputs always recorded), cached under `cache_dir`/<key>/ (None: no
    cache; "default": $MOESCOPE_ROUTING_CACHE, else runs/routing_cache).

    Returns the trace (gate inputs dropped unless `with_hidden`), the batch start times and a note:
    {"key", "path", "cached": whether the recording was read from the cache}.
    """
    if cache_dir == "default":
        cache_dir = os.environ.get("MOESCOPE_ROUTING_CACHE", str(CACHE_DIR))
    key = cache_key(checkpoint, workload, max_batches, seed)
    folder = None if cache_dir is None else Path(cache_dir) / key
    note: dict[str, Any] = {"key": key, "path": None if folder is None else str(folder), "cached": False}
    if folder is not None and (folder / "trace.npz").is_file() and (folder / "starts.npy").is_file():
        note["cached"] = True
        return RoutingTrace.load(folder / "trace.npz", with_hidden=with_hidden), np.load(folder / "starts.npy"), note
    trace, starts = record_replay_routing(checkpoint, workload, max_batches, seed, progress, capture_hidden=True)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        trace.save(folder / "trace.npz")
        np.save(folder / "starts.npy", starts)
        (folder / "inputs.json").write_text(json.dumps({"checkpoint": str(checkpoint), "max_batches": max_batches,
                                                        "seed": seed, "version": CACHE_VERSION}, indent=1))
    if not with_hidden:
        trace = dataclasses.replace(trace, hidden=None)
    return trace, starts, note
