"""Trace replay (MoEless §6.1): Azure arrivals and token counts, with real prompt text as content.

Each request of the trace gets a prompt drawn (seeded) from a text workload and cut or extended to
exactly its `ContextTokens` (a request longer than its prompt runs on into the next sampled prompts,
separator between), and asks for exactly its `GeneratedTokens`. Requests are grouped by arrival
into per-interval batches (1 s in MoEless, which batches each second's requests because
Megatron-LM has no continuous batching).

    replay = TraceReplay(load_azure_trace("conv").window(0, 60), load_sharegpt(), tokenizer, seed=0)
    for batch in replay:            # 60 batches, empty seconds included
        batch.tokens, batch.gen_lens
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from engine.workloads.azure import AzureTrace, RequestBatch, RequestBatches
from core.texts import TextPrompt, Tokenizer
from engine.workloads.prompts import TokenStream


@dataclass(frozen=True)
class ReplayBatch:
    """The requests of one interval with their prompt tokens (exact trace lengths)."""

    requests: RequestBatch
    prompt_ids: tuple[tuple[str, ...], ...]  # per request: the source prompt(s) of its tokens
    tokens: tuple[tuple[int, ...], ...]  # [n][ContextTokens_i]

    @property
    def index(self) -> int:
        return self.requests.index

    @property
    def start_s(self) -> float:
        return self.requests.start_s

    @property
    def num_requests(self) -> int:
        return self.requests.num_requests

    @property
    def gen_lens(self) -> np.ndarray:
        """int64 [n]: tokens each request generates."""
        return self.requests.generated_tokens


class TraceReplay:
    """Iterate an Azure trace as per-interval batches of tokenised requests (deterministic by seed)."""

    def __init__(self, trace: AzureTrace, prompts: Sequence[TextPrompt], tokenizer: Tokenizer, *,
                 interval_s: float = 1.0, seed: int = 0, separator_id: Optional[int] = None):
        self.trace = trace
        self.batches: RequestBatches = trace.per_interval(interval_s)
        self._prompts, self._tokenizer = list(prompts), tokenizer
        self._seed, self._sep = seed, separator_id

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[ReplayBatch]:
        stream = TokenStream(self._prompts, self._tokenizer, self._seed, self._sep)
        for req in self.batches:
            taken = [stream.take(int(n)) for n in req.context_tokens]
            yield ReplayBatch(req, tuple(t[0] for t in taken), tuple(t[1] for t in taken))
