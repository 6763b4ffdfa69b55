"""Training corpus and byte-level BPE tokenizer: split by document, HF-format round trip through transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.corpus import Corpus, CorpusConfig, CorpusSource, build_corpus, source_documents, split_documents
from models.loading import load_tokenizer
from models.tokenizer import BOS, EOS, PAD, save_hf_tokenizer, special_token_ids, train_bpe

VOCAB = 1024


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return build_corpus(CorpusConfig(max_chars=150_000, validation_fraction=0.1))


@pytest.fixture(scope="module")
def folder(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = train_bpe(corpus.texts("train"), vocab_size=VOCAB)
    return save_hf_tokenizer(tok, tmp_path_factory.mktemp("tok"), model_max_length=1024)


# ---- corpus ----------------------------------------------------------------------------------------------
def test_corpus_has_every_source_capped_and_split_by_document(corpus: Corpus) -> None:
    stats = corpus.stats()
    for source in CorpusSource:
        train = stats["train"][source.value]
        assert train["documents"] > 0
        assert train["chars"] + stats["validation"].get(source.value, {"chars": 0})["chars"] <= 150_000 + 3500
    train_ids = {d.id for d in corpus.train}
    val_ids = {d.id for d in corpus.validation}
    assert val_ids and not train_ids & val_ids
    assert stats["stdlib"]["files"] > 100


def test_split_is_deterministic_and_stable_when_documents_are_added() -> None:
    docs = source_documents(CorpusSource.sharegpt)
    train, val = split_documents(docs, 0.2, "salt")
    assert 60 <= len(val) <= 140  # ~100 of 500
    sub_train, sub_val = split_documents(docs[:250], 0.2, "salt")
    assert {d.id for d in sub_val} == {d.id for d in val} & {d.id for d in docs[:250]}
    assert split_documents(docs, 0.2, "other")[1] != val
    with pytest.raises(ValueError, match="validation_fraction"):
        split_documents(docs, 1.0, "salt")


# ---- tokenizer -------------------------------------------------------------------------------------------
def test_training_is_deterministic_with_specials_first(corpus: Corpus) -> None:
    texts = list(corpus.texts("train"))[:300]
    a, b = train_bpe(texts, vocab_size=512), train_bpe(texts, vocab_size=512)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 512
    assert special_token_ids(a) == {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(texts, vocab_size=100)


def test_transformers_loads_the_folder_and_agrees_with_tokenizers(folder: Path, corpus: Corpus) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    ours = load_tokenizer(folder)
    assert ours is not None and ours.get_vocab_size() == VOCAB == len(hf)
    assert (hf.pad_token, hf.bos_token, hf.eos_token) == (PAD, BOS, EOS)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert hf.model_max_length == 1024
    for text in list(corpus.texts("validation"))[:20]:
        ids = ours.encode(text).ids
        assert hf.encode(text) == ids  # no special tokens added by either
        assert hf.decode(ids) == text == ours.decode(ids)
    batch = hf(["a b c d", "a"], padding=True)
    assert batch["input_ids"][1][0] == 0 and batch["attention_mask"][1][:3] == [0, 0, 0]  # left padding


def test_learned_merges_compress_held_out_text(folder: Path, corpus: Corpus) -> None:
    tok = load_tokenizer(folder)
    text = "".join(corpus.texts("validation"))
    assert len(tok.encode(text).ids) < 0.5 * len(text.encode())  # bytes per token > 2 on unseen documents


@pytest.fixture(scope="module")
def tok(folder: Path):
    return load_tokenizer(folder)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_any_text_round_trips(tok, text: str) -> None:
    assert tok.decode(tok.encode(text).ids) == text
