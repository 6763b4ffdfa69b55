"""The tokenizer a GGUF file carries (models/gguf_tokenizer.py): the shipped tiny model's byte-level BPE written by the
converter comes back encoding exactly as its tokenizer.json; a SentencePiece (`llama`) vocabulary merges by score
with byte fallback; a tokenizer that does not fit the model's vocabulary is a one-line error."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer

from core.config import resolve_path
from engine.bench.peers.to_gguf import convert
from models.gguf import open_gguf
from models.gguf_tokenizer import check_vocab, load_tokenizer_for, tokenizer_from_gguf
from models.hf import CheckpointError

TEXTS = ["Hello world!  The quick brown fox's <|eos|> jumps\n\nover 12345 lazy dogs.",
         "Ünïcödé 漢字 🙂 tabs\tand   spaces ", "<|bos|>once upon a time<|eos|>"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path]:
    src = resolve_path("pkg:models/checkpoints/mixtral-tiny")
    dst = tmp_path_factory.mktemp("tok") / "tiny.gguf"
    convert(src, dst)
    return src, dst


def test_gpt2_tokenizer_encodes_as_the_original(tiny_gguf) -> None:
    src, path = tiny_gguf
    want = Tokenizer.from_file(str(src / "tokenizer.json"))
    got = tokenizer_from_gguf(path)
    assert got.get_vocab_size() == want.get_vocab_size()
    for text in TEXTS:
        assert got.encode(text).ids == want.encode(text).ids, text
        assert got.decode(got.encode(text).ids, skip_special_tokens=False) == text
    tok = load_tokenizer_for(path, None, open_gguf(path).cfg)
    assert tok.encode(TEXTS[0]).ids == want.encode(TEXTS[0]).ids


def _write(path: Path, tokens: list[str], types: list[int], scores: list[float], **extra: str) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(extra.get("model", "llama"))
    if "pre" in extra:
        w.add_tokenizer_pre(extra["pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sentencepiece_vocabulary_merges_by_score_with_byte_fallback(tmp_path) -> None:
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "▁abc", "bc"]
    # scores rank the merges: "▁a" (-3) before "ab" (-4) and "bc" (-6), so "abc" goes ▁a, ▁ab, ▁abc
    scores = [0.0] * 259 + [-10.0, -10.0, -10.0, -10.0, -3.0, -4.0, -1.0, -1.5, -6.0]
    tokens = ["<unk>", "<s>", "</s>"] + bytes_ + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    tok = tokenizer_from_gguf(_write(tmp_path / "spm.gguf", tokens, types, scores))
    ids = tok.encode("abc ab").ids
    assert [tokens[i] for i in ids] == ["▁abc", "▁ab"]
    # "é" is not a piece: its UTF-8 bytes through the <0xNN> tokens, and back
    enc = tok.encode("aé")
    assert [tokens[i] for i in enc.ids] == ["▁a", "<0xC3>", "<0xA9>"]
    assert tok.decode(enc.ids) == "aé"
    assert tok.encode("<s>").ids == [1]  # a control token is one id


def test_unknown_pretokenizer_is_named(tmp_path) -> None:
    path = _write(tmp_path / "pre.gguf", ["a", "b", "ab"], [1, 1, 1], [0.0] * 3, model="gpt2", pre="deepseek-v3")
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.pre = 'deepseek-v3' .*model\.tokenizer="):
        tokenizer_from_gguf(path)


def test_tokenizer_larger_than_the_vocabulary_is_refused(tiny_gguf, tmp_path) -> None:
    src, path = tiny_gguf
    cfg = open_gguf(path).cfg
    small = cfg.replace(vocab_size=1000)
    with pytest.raises(CheckpointError) as err:
        load_tokenizer_for(path, str(src), small)  # model.tokenizer=<the 4096-token HF folder>
    msg = str(err.value)
    assert "model.tokenizer" in msg and "4095" in msg and "vocab_size" in msg and "1000" in msg and "\n" not in msg
    with pytest.raises(CheckpointError, match="1000"):
        load_tokenizer_for(path, None, small)  # the file's own tokenizer, against a smaller model
    assert check_vocab(tokenizer_from_gguf(path), cfg, "x") is not None
    with pytest.raises(CheckpointError, match="not found"):
        load_tokenizer_for(path, str(tmp_path / "nowhere"), cfg)


@pytest.mark.parametrize("ab, bc, want", [(-1.0, -2.0, ["▁", "ab", "c"]), (-2.0, -1.0, ["▁", "a", "bc"])])
def test_the_higher_scored_piece_merges_first(tmp_path, ab, bc, want) -> None:
    tokens = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "a", "b", "c", "ab", "bc"]
    types = [2] + [6] * 256 + [1] * 6
    scores = [0.0] * 257 + [-5.0, -5.0, -5.0, -5.0, ab, bc]
    tok = tokenizer_from_gguf(_write(tmp_path / "rank.gguf", tokens, types, scores))
    assert [tokens[i] for i in tok.encode("abc").ids] == want


def test_metadata_arrays_are_held_whole_with_the_packages_values(tiny_gguf, tmp_path) -> None:
    """`GGUFFile`'s reader keeps each metadata array as a few views (the package's reader keeps one numpy view per
    element and per string length: 0.5 GB for a 151,936-token vocabulary), with the package's values: strings,
    integers, floats, bools and arrays, whole, by index and by slice."""
    from models.gguf import ArrayField, GGUFFile

    w = gguf.GGUFWriter(tmp_path / "kinds.gguf", "llama")
    w.add_array("t.strings", ["", "a", "Ünï 漢字 🙂", "x" * 300])
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty", [])
    w.add_string("t.scalar", "one")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for path in (tiny_gguf[1], tmp_path / "kinds.gguf"):
        lean, ref = GGUFFile(path).reader, gguf.GGUFReader(path, "r")
        assert list(lean.fields) == list(ref.fields)
        for key, want in ref.fields.items():
            got = lean.fields[key]
            assert got.types == want.types and got.contents() == want.contents(), key
            if want.types[0] == gguf.GGUFValueType.ARRAY and want.data:
                assert isinstance(got, ArrayField) and len(got.parts) <= 8 and got.count == len(want.data), key
                for i in (0, len(want.data) // 2, -1):
                    assert got.contents(i) == want.contents(i), (key, i)
                assert got.contents(slice(1, 3)) == want.contents(slice(1, 3)), key
        assert [(t.name, t.data_offset, t.n_bytes) for t in lean.tensors] == \
            [(t.name, t.data_offset, t.n_bytes) for t in ref.tensors]
    tokens = GGUFFile(tiny_gguf[1]).reader.fields["tokenizer.ggml.tokens"]
    assert tokens.count > 1000 and len(tokens.parts) < 10
