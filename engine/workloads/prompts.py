"""Batches of tokenised prompts from a text workload: length policy and a deterministic seeded sampler.

    sampler = PromptSampler(load_sharegpt(), tokenizer, batch_size=8, prompt_len=512, gen_len=64,
                            policy=LengthPolicy.pack, seed=0, separator_id=eos_id)
    for batch in sampler.batches(16):
        generator.generate(batch.tokens, batch.gen_len, ...)

Prompts are drawn without replacement in epochs: a seeded permutation of all prompts, then another,
and so on; the same (prompts, tokenizer, seed, sizes) always give the same batches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from engine.workloads.config import LengthPolicy
from core.texts import TextPrompt, Tokenizer, encode_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptBatch:
    """One batch: B token-id prompts (ragged unless packed), their source prompt ids, gen length.

    `pad_to` is the length to pad to (left padding is the generator's job, e.g.
    `models.generation.left_pad(batch.tokens, batch.pad_to, pad_id)`); None pads to the longest.
    """

    index: int
    prompt_ids: tuple[tuple[str, ...], ...]  # per prompt: the source prompt(s) it was cut from
    tokens: tuple[tuple[int, ...], ...]  # [B][T_b]
    gen_len: int
    pad_to: Optional[int] = None

    @property
    def batch_size(self) -> int:
        return len(self.tokens)

    @property
    def lengths(self) -> np.ndarray:
        """int64 [B]: real (unpadded) prompt lengths."""
        return np.array([len(t) for t in self.tokens], dtype=np.int64)

    def token_lists(self) -> list[list[int]]:
        return [list(t) for t in self.tokens]


def in_flight(batches: Sequence[PromptBatch], n: int) -> list[PromptBatch]:
    """`batches` taken `n` at a time, each group one batch of their prompts (a policy that keeps `n` batches in
    flight runs them through every layer together); a short last group when `n` does not divide them."""
    if n <= 1:
        return list(batches)
    groups = [batches[i:i + n] for i in range(0, len(batches), n)]
    return [PromptBatch(index=g[0].index, prompt_ids=tuple(p for b in g for p in b.prompt_ids),
                        tokens=tuple(t for b in g for t in b.tokens), gen_len=max(b.gen_len for b in g),
                        pad_to=None if any(b.pad_to is None for b in g) else max(b.pad_to for b in g))
            for g in groups]


class TokenStream:
    """An endless, seeded stream of tokenised prompts: epochs of random permutations.

    Prompts are encoded when first drawn (then cached), so a large prompt set costs only what is
    used. Prompts with fewer than `min_tokens` tokens are skipped. `next_prompt()` returns the next
    whole prompt; `take(n)` returns exactly n tokens that start at the beginning of a fresh prompt
    and run on into the following ones (`separator_id` between).
    """

    def __init__(self, prompts: Sequence[TextPrompt], tokenizer: Tokenizer, seed: int,
                 separator_id: Optional[int] = None, min_tokens: int = 1):
        if not prompts:
            raise ValueError("TokenStream: no prompts")
        self._prompts = list(prompts)
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[int, ...]] = {}
        self._rng = np.random.default_rng(seed)
        self._order: list[int] = []
        self._sep = () if separator_id is None else (int(separator_id),)
        self._min = max(int(min_tokens), 1)
        self._epoch = 0

    def _encoded(self, i: int) -> tuple[int, ...]:
        if i not in self._cache:
            self._cache[i] = tuple(encode_ids(self._tokenizer, self._prompts[i].text))
        return self._cache[i]

    def next_prompt(self) -> tuple[str, tuple[int, ...]]:
        skipped: set[int] = set()
        while True:
            if not self._order:
                if self._epoch:
                    log.info("workload: all %d prompts drawn; epoch %d draws them again in a new order",
                             len(self._prompts), self._epoch + 1)
                self._epoch += 1
                self._order = self._rng.permutation(len(self._prompts)).tolist()[::-1]
            i = self._order.pop()
            toks = self._encoded(i)
            if len(toks) >= self._min:
                return self._prompts[i].id, toks
            skipped.add(i)
            if len(skipped) == len(self._prompts):
                raise ValueError(f"no prompt has >= {self._min} tokens (of {len(self._prompts)} prompts)")

    def take(self, n: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Exactly n tokens (n >= 1) and the ids of the prompts they came from."""
        if n < 1:
            raise ValueError(f"TokenStream.take: n must be >= 1, got {n}")
        ids: list[str] = []
        out: list[int] = []
        while len(out) < n:
            pid, toks = self.next_prompt()
            if out:
                out.extend(self._sep)
            ids.append(pid)
            out.extend(toks)
        return tuple(ids), tuple(out[:n])


class PromptSampler:
    """Deterministic batches of a text workload under a length policy.

    prompts: the workload's text prompts; tokenizer: anything with `encode` (see `base.encode_ids`);
    prompts with fewer than `min_prompt_tokens` tokens are skipped (truncate / pad policies).
    `separator_id` (usually EOS) goes between prompts joined by the pack policy.
    """

    def __init__(self, prompts: Sequence[TextPrompt], tokenizer: Tokenizer, *, batch_size: int, prompt_len: int,
                 gen_len: int, policy: LengthPolicy = LengthPolicy.truncate, seed: int = 0,
                 min_prompt_tokens: int = 1, separator_id: Optional[int] = None):
        for name, value, low in (("batch_size", batch_size, 1), ("prompt_len", prompt_len, 1),
                                 ("gen_len", gen_len, 0), ("min_prompt_tokens", min_prompt_tokens, 1)):
            if value < low:
                raise ValueError(f"{name}: must be >= {low}, got {value}")
        if policy is not LengthPolicy.pack and batch_size > len(prompts):
            raise ValueError(f"workload.batch_size: {batch_size} exceeds the workload's {len(prompts)} prompts, so a "
                             "batch would hold one prompt twice; use a smaller batch or workload.policy=pack")
        if policy is not LengthPolicy.pack and min_prompt_tokens > prompt_len:
            raise ValueError(f"min_prompt_tokens ({min_prompt_tokens}) > prompt_len ({prompt_len})")
        self.batch_size, self.prompt_len, self.gen_len, self.policy = batch_size, prompt_len, gen_len, policy
        min_tokens = 1 if policy is LengthPolicy.pack else min_prompt_tokens
        self._stream = TokenStream(prompts, tokenizer, seed, separator_id, min_tokens)
        self._next_index = 0

    def next_batch(self) -> PromptBatch:
        ids, toks = [], []
        for _ in range(self.batch_size):
            if self.policy is LengthPolicy.pack:
                pids, t = self._stream.take(self.prompt_len)
            else:
                pid, full = self._stream.next_prompt()
                pids, t = (pid,), full[: self.prompt_len]
            ids.append(pids)
            toks.append(t)
        pad_to = self.prompt_len if self.policy is not LengthPolicy.truncate else None
        batch = PromptBatch(self._next_index, tuple(ids), tuple(toks), self.gen_len, pad_to)
        self._next_index += 1
        return batch

    def batches(self, num_batches: int) -> Iterator[PromptBatch]:
        """The next `num_batches` batches (a fresh sampler with the same seed repeats them)."""
        for _ in range(num_batches):
            yield self.next_batch()
