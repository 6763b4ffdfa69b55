"""Real routing for the simulator: a trained model serves the replayed Azure requests and its
router decisions are recorded.

MoEless §6.1 samples request text from a prompt dataset and replays the Azure arrivals and token
counts. Here a checkpoint with a trained router (e.g. the shipped mixtral-tiny, 8 experts top-2,
trained without a balancing loss) serves each per-second batch: the prompts are ShareGPT text cut
to each request's exact `ContextTokens` (`engine.workloads.TraceReplay`), and every request
decodes exactly its `GeneratedTokens` (greedy, no EOS stop). The trace keeps the routing of every
prefill and decode token, so expert loads vary with the content as they do in production. A
paper-scale model with the same expert count and top-k is then simulated on it, its MoE layers
cycling through the recorded ones (`engine.sim.run.tile_layers`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from core.trace import RoutingTrace, TraceRecorder


def record_replay_routing(checkpoint: str, workload: Any, max_batches: int | None = None, seed: int = 0,
                          progress: Callable = lambda it, desc: it) -> tuple[RoutingTrace, np.ndarray]:
    """Serve the Azure replay of `workload` (an azure `WorkloadConfig`) with the model at `checkpoint`.

    Returns the routing trace (one batch per non-empty interval, prefill then decode steps) and the
    start time (s) of each recorded batch.
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
                         f"{cfg.max_position_embeddings}; cap workload.azure.max_context_tokens / max_generated_tokens")
    recorder = TraceRecorder(trace_meta(cfg, spec["name"], f"azure replay: {workload.name}"))
    generator = Generator(model, capture=True)
    starts, first = [], 0
    for b in progress(batches, "record routing"):
        prompts = [list(t) for t in b.tokens]
        gen = np.maximum(b.gen_lens.astype(np.int64), 1)
        out = generator.generate(prompts, int(gen.max()), pad_token_id=cfg.pad_token_id)
        record_generation(recorder, dataclasses.replace(out, lengths=gen), prompts, range(first, first + len(prompts)))
        starts.append(b.start_s)
        first += len(prompts)
    return recorder.build(), np.asarray(starts, dtype=np.float64)
