"""Batches of tokenised prompts from a text workload: length policy and a deterministic seeded sampler.

    sampler = PromptSampler(load_sharegpt(), tokenizer, batch_size=8, prompt_len=512, gen_len=64,
                            policy=LengthPolicy.pack, seed=0, separator_id=eos_id)
    for batch in sampler.batches(16):
        generator.generate(batch.tokens, batch.gen_len, ...)

Prompts are drawn without replacement in epochs: a seeded permutation of all prompts, then another,
and so on; the same (prompts, tokenizer, seed, sizes) always give the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from conf.schemas.workload import LengthPolicy
from engine.workloads.base import TextPrompt, Tokenizer, encode_all


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


class TokenStream:
    """An endless, seeded stream of tokenised prompts: epochs of random permutations.

    `next_prompt()` returns the next whole prompt; `take(n)` returns exactly n tokens that start at
    the beginning of a fresh prompt and run on into the following ones (separator between).
    """

    def __init__(self, prompt_ids: Sequence[str], encoded: Sequence[Sequence[int]], seed: int,
                 separator_id: Optional[int] = None):
        if len(prompt_ids) != len(encoded) or not encoded:
            raise ValueError("TokenStream: need as many encodings as prompt ids, and at least one")
        if all(len(e) == 0 for e in encoded):
            raise ValueError("TokenStream: every prompt encodes to zero tokens")
        self._ids = list(prompt_ids)
        self._enc = [tuple(int(t) for t in e) for e in encoded]
        self._rng = np.random.default_rng(seed)
        self._order: list[int] = []
        self._sep = () if separator_id is None else (int(separator_id),)

    def next_index(self) -> int:
        if not self._order:
            self._order = self._rng.permutation(len(self._enc)).tolist()[::-1]
        return self._order.pop()

    def next_prompt(self) -> tuple[str, tuple[int, ...]]:
        i = self.next_index()
        return self._ids[i], self._enc[i]

    def take(self, n: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Exactly n tokens (n >= 1) and the ids of the prompts they came from."""
        if n < 1:
            raise ValueError(f"TokenStream.take: n must be >= 1, got {n}")
        ids: list[str] = []
        out: list[int] = []
        while len(out) < n:
            pid, toks = self.next_prompt()
            if not toks:
                continue
            if out:
                out.extend(self._sep)
            ids.append(pid)
            out.extend(toks)
        return tuple(ids), tuple(out[:n])


class PromptSampler:
    """Deterministic batches of a text workload under a length policy.

    prompts: the workload's text prompts; tokenizer: anything with `encode` (see `base.encode_ids`);
    prompts with fewer than `min_prompt_tokens` tokens are left out (truncate / pad policies).
    `separator_id` (usually EOS) goes between prompts joined by the pack policy.
    """

    def __init__(self, prompts: Sequence[TextPrompt], tokenizer: Tokenizer, *, batch_size: int, prompt_len: int,
                 gen_len: int, policy: LengthPolicy = LengthPolicy.truncate, seed: int = 0,
                 min_prompt_tokens: int = 1, separator_id: Optional[int] = None):
        for name, value, low in (("batch_size", batch_size, 1), ("prompt_len", prompt_len, 1),
                                 ("gen_len", gen_len, 0), ("min_prompt_tokens", min_prompt_tokens, 1)):
            if value < low:
                raise ValueError(f"{name}: must be >= {low}, got {value}")
        if policy is not LengthPolicy.pack and min_prompt_tokens > prompt_len:
            raise ValueError(f"min_prompt_tokens ({min_prompt_tokens}) > prompt_len ({prompt_len})")
        self.batch_size, self.prompt_len, self.gen_len, self.policy = batch_size, prompt_len, gen_len, policy
        encoded = encode_all(tokenizer, [p.text for p in prompts])
        keep = [i for i, e in enumerate(encoded) if len(e) >= (1 if policy is LengthPolicy.pack else min_prompt_tokens)]
        if not keep:
            raise ValueError(f"no prompt has >= {min_prompt_tokens} tokens (of {len(prompts)} prompts)")
        self.num_prompts = len(keep)
        self._stream = TokenStream([prompts[i].id for i in keep], [encoded[i] for i in keep], seed, separator_id)
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
