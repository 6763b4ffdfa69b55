"""Routing traces from generation: the captured routing of a `GenerationOutput` as trace steps.

Padding columns of the left-padded prefill and decode steps of rows that already stopped are
dropped, so the trace holds exactly the (token, layer) pairs a real server would route.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from core.trace import DECODE, PREFILL, TraceMeta, TraceRecorder
from models.config import ModelConfig
from models.generation import GenerationOutput


def trace_meta(cfg: ModelConfig, model_name: str, source: str) -> TraceMeta:
    return TraceMeta(model=model_name, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                     moe_layers=cfg.moe_layers, hidden_size=cfg.hidden_size, family=cfg.family.value, source=source)


def record_generation(recorder: TraceRecorder, out: GenerationOutput, prompts: Sequence[Sequence[int]],
                      seq_ids: Optional[Sequence[int]] = None) -> None:
    """Append the prefill step and every decode step of `out` (generated with capture on) to `recorder`."""
    if out.prefill_capture is None or out.decode_capture is None:
        raise ValueError("record_generation: generate with Generator(capture=True) to record routing")
    B = len(prompts)
    seq = np.arange(B) if seq_ids is None else np.asarray(seq_ids)
    P = out.padded_prompt_len
    keep_hidden = recorder.keep_hidden
    pre = out.prefill_capture
    rows_b, rows_c = [], []
    for b, prompt in enumerate(prompts):
        cols = np.arange(P - len(prompt), P)
        rows_b.append(np.full(len(cols), b))
        rows_c.append(cols)
    rb, rc = np.concatenate(rows_b), np.concatenate(rows_c)
    pos = np.concatenate([np.arange(len(p)) for p in prompts])
    toks = np.concatenate([np.asarray(p) for p in prompts])
    recorder.add_step([np.asarray(e)[rb, rc] for e in pre.experts], [np.asarray(w)[rb, rc] for w in pre.weights],
                      seq=seq[rb], pos=pos, token=toks, phase=PREFILL,
                      hidden=[np.asarray(h)[rb, rc] for h in pre.hidden] if keep_hidden else None)
    dec = out.decode_capture
    prompt_len = np.array([len(p) for p in prompts])
    for s in range(dec.experts.shape[0]):
        live = np.flatnonzero(s <= out.lengths - 2)  # decode step s feeds generated token s of each live row
        if live.size == 0:
            break
        recorder.add_step([np.asarray(e)[live] for e in dec.experts[s]], [np.asarray(w)[live] for w in dec.weights[s]],
                          seq=seq[live], pos=prompt_len[live] + s, token=out.tokens[live, s], phase=DECODE,
                          hidden=[np.asarray(h)[live] for h in dec.hidden[s]] if keep_hidden else None)
