"""Byte-level BPE tokenizer of the shipped tiny models: trained offline with `tokenizers`, saved in HF format.

    tok = train_bpe(corpus.train_texts(), vocab_size=4096)
    save_hf_tokenizer(tok, "models/checkpoints/tiny_mixtral", model_max_length=1024)
    AutoTokenizer.from_pretrained("models/checkpoints/tiny_mixtral")   # transformers users
    models.loading.load_tokenizer(folder)                               # our code (tokenizer.json)

Byte-level: every string round-trips exactly (no unknown token, no normalisation). Special tokens
take the first ids: `<|pad|>` 0, `<|bos|>` 1, `<|eos|>` 2. Encoding adds none of them; the
training recipe and the generator place BOS / EOS themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from core.telemetry import atomic_write_text

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2 in this order
_MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # specials + the byte alphabet


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2,
              max_token_length: int = 16) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `texts` (deterministic for the same texts in the same order).

    `vocab_size` counts the special tokens and the 256 byte symbols; `max_token_length` (characters)
    keeps long runs such as `=====` out of the vocabulary.
    """
    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size: must be >= {_MIN_VOCAB} (3 special tokens + 256 bytes), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS), max_token_length=max_token_length,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"train_bpe: special token {name} got id {tok.token_to_id(name)}, expected {i}")
    return tok


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """{'pad_token_id', 'bos_token_id', 'eos_token_id'} as a model config.json names them."""
    ids = {f"{role}_token_id": tok.token_to_id(name) for role, name in zip(("pad", "bos", "eos"), SPECIAL_TOKENS)}
    missing = [k for k, v in ids.items() if v is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens for {missing} (expected {SPECIAL_TOKENS})")
    return ids  # type: ignore[return-value]


def save_hf_tokenizer(tok: Tokenizer, folder: str | Path, model_max_length: int = 1024) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `folder` (atomically)."""
    folder = Path(folder)
    special_token_ids(tok)
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": int(model_max_length),
        "padding_side": "left",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    atomic_write_text(folder / "tokenizer.json", tok.to_str(pretty=True))
    atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    atomic_write_text(folder / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")
    return folder
