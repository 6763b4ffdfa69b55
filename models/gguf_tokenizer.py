"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`), rebuilt as a `tokenizers.Tokenizer`, and the check that a
tokenizer fits a model's vocabulary.

    tok = tokenizer_from_gguf("model.gguf")            # or models.loading's model.tokenizer=<HF folder>
    check_vocab(tok, cfg, "model.gguf")                 # a token id the embedding lacks is an error

Two of llama.cpp's tokenizer models are rebuilt:

* `gpt2` (byte-level BPE: Qwen, DeepSeek, OLMoE, the shipped tiny models): the tokens and merges as they are, the
  pre-tokenizer's split regex chosen by `tokenizer.ggml.pre` (the GPT-2 split for `default` / `gpt-2` / `olmo`,
  the Llama-3 split for `llama-bpe` / `llama3` / `smaug-bpe`, Qwen2's for `qwen2`); any other `pre` is an error
  naming it (a wrong split tokenizes silently wrong), to be overridden with `model.tokenizer=<HF folder>`;
* `llama` (SentencePiece BPE: Mixtral, Phi-3.5-MoE): the pieces with their scores, merges derived as
  SentencePiece ranks them (a pair merges with the score of the piece it makes), byte fallback to `<0xNN>`
  tokens, `▁` for spaces with the leading space `tokenizer.ggml.add_space_prefix` asks for.

Control and user-defined tokens (`tokenizer.ggml.token_type` 3 / 4) become added tokens, so they encode as one id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from models.config import ModelConfig
from models.hf import CheckpointError

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6  # llama_token_type
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex (None: the GPT-2 split built into the ByteLevel pre-tokenizer)
BPE_SPLITS: dict[str, Optional[str]] = {"default": None, "gpt-2": None, "olmo": None, "llama-bpe": _LLAMA3_SPLIT,
                                        "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def tokenizer_from_gguf(path: str | Path) -> Optional[Tokenizer]:
    """The file's tokenizer, or None where the file carries none. A `CheckpointError` for a tokenizer model or
    pre-tokenizer that is not rebuilt here (naming the key and value)."""
    from models.gguf import GGUFFile

    f = GGUFFile(path)
    kind = _field(f.reader, "tokenizer.ggml.model")
    if kind is None:
        return None
    tokens = list(_field(f.reader, "tokenizer.ggml.tokens", []))
    types = list(_field(f.reader, "tokenizer.ggml.token_type", [_NORMAL] * len(tokens)))
    if len(types) != len(tokens):
        raise CheckpointError(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries for "
                              f"{len(tokens)} tokenizer.ggml.tokens")
    if kind == "gpt2":
        tok = _byte_level_bpe(f, tokens)
    elif kind == "llama":
        scores = list(_field(f.reader, "tokenizer.ggml.scores", [0.0] * len(tokens)))
        if len(scores) != len(tokens):
            raise CheckpointError(f"{f.path}: tokenizer.ggml.scores has {len(scores)} entries for "
                                  f"{len(tokens)} tokenizer.ggml.tokens")
        tok = _sentencepiece_bpe(tokens, types, scores, bool(_field(f.reader, "tokenizer.ggml.add_space_prefix", True)))
    else:
        raise CheckpointError(f"{f.path}: tokenizer.ggml.model = {kind!r} is not rebuilt (gpt2, llama); pass "
                              "model.tokenizer=<HF folder with tokenizer.json>")
    specials = [AddedToken(t, special=ty == _CONTROL, normalized=False)
                for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens([a for a in specials if a.special])
    tok.add_tokens([a for a in specials if not a.special])
    return tok


def _byte_level_bpe(f: Any, tokens: list[str]) -> Tokenizer:
    pre = str(_field(f.reader, "tokenizer.ggml.pre", "default"))
    if pre not in BPE_SPLITS:
        raise CheckpointError(f"{f.path}: tokenizer.ggml.pre = {pre!r} is not rebuilt (known: "
                              f"{', '.join(BPE_SPLITS)}); pass model.tokenizer=<HF folder with tokenizer.json>")
    merges = [tuple(m.split(" ", 1)) for m in _field(f.reader, "tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=pre in ("llama-bpe", "llama3")))
    split = BPE_SPLITS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], types: list[int], scores: list[float], space_prefix: bool) -> Tokenizer:
    """SentencePiece BPE: a pair (a, b) merges at the rank of the piece a + b by its score (higher first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = sorted((i for i, ty in enumerate(types) if ty in (_NORMAL, _USER_DEFINED)),
                    key=lambda i: (-scores[i], i))
    merges: list[tuple[str, str]] = []
    for i in ranked:
        piece = tokens[i]
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]]))
    unk = next((tokens[i] for i, ty in enumerate(types) if ty == _UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return tok


def check_vocab(tok: Tokenizer, cfg: ModelConfig, where: str) -> Tokenizer:
    """`tok` if every id it can produce is a row of the model's embedding; else a one-line CheckpointError."""
    largest = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if largest >= cfg.vocab_size:
        raise CheckpointError(f"{where}: tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens (ids up to "
                              f"{largest}) but the model's vocabulary (vocab_size) is {cfg.vocab_size}")
    return tok


def load_tokenizer_for(checkpoint: Optional[Path], override: Optional[str | Path], cfg: ModelConfig
                       ) -> Optional[Tokenizer]:
    """The tokenizer a model runs with: `override` (an HF folder holding tokenizer.json, or a tokenizer.json),
    else the GGUF file's own, else the tokenizer.json beside an HF checkpoint; checked against `cfg`'s vocabulary."""
    if override is not None:
        path = Path(override)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise CheckpointError(f"model.tokenizer: {path} not found (an HF folder with tokenizer.json)")
        return check_vocab(Tokenizer.from_file(str(path)), cfg, f"model.tokenizer {path}")
    if checkpoint is None:
        return None
    from models.gguf import is_gguf_path

    if is_gguf_path(checkpoint):
        tok = tokenizer_from_gguf(checkpoint)
    elif (Path(checkpoint) / "tokenizer.json").is_file():
        tok = Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
    else:
        return None
    return None if tok is None else check_vocab(tok, cfg, str(checkpoint))
