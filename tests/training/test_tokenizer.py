"""Byte-level BPE tokenizer and the code corpus it is trained on."""

from __future__ import annotations

import sysconfig

import pytest

from training.corpus import CorpusConfig, iter_documents
from training.tokenizer import (
    SPECIAL_TOKENS,
    TokenizerError,
    TokenizerTrainingConfig,
    default_tokenizer,
    load_tokenizer,
    train_tokenizer,
    train_tokenizer_on_corpus,
)

SAMPLES = [
    "def add(a, b):\n    return a + b\n",
    "class Foo:\n\tpass  # tabs, ünïcödé, 漢字 and 🚀\r\n",
    "x = {'k': [1, 2.5e-3, None]}\n\n\n",
    "",
    "\x00\x7f raw control bytes",
]


def test_corpus_reads_this_interpreters_stdlib_up_to_the_byte_cap(tmp_path):
    documents = list(iter_documents(CorpusConfig(max_bytes=200_000)))
    stdlib = sysconfig.get_paths()["stdlib"]
    assert len(documents) > 3 and all(d.path.startswith(stdlib) for d in documents)
    assert sum(len(d.text.encode()) for d in documents) <= 200_000
    assert not any("/site-packages/" in d.path for d in documents)
    (tmp_path / "mine.py").write_text("print('extra')\n")
    extra = list(iter_documents(CorpusConfig(include_stdlib=False, extra_dirs=(str(tmp_path),))))
    assert [d.text for d in extra] == ["print('extra')\n"]
    with pytest.raises(ValueError, match="does not exist"):
        CorpusConfig(extra_dirs=(str(tmp_path / "missing"),))
    with pytest.raises(ValueError, match="corpus is empty"):
        CorpusConfig(include_stdlib=False)


def test_trained_tokenizer_round_trips_text_and_keeps_special_tokens_atomic():
    tokenizer = default_tokenizer(2048)
    assert tokenizer.vocab_size == 2048
    assert [tokenizer.token_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.encode("a<|im_start|>user\nhi<|im_end|>")
    assert tokenizer.turn_start_id in ids and tokenizer.turn_end_id in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "auser\nhi"
    # BPE on code compresses: common Python is well under one token per character
    code = "    def __init__(self, config):\n        self.config = config\n"
    assert len(tokenizer.encode(code)) < len(code) / 2.5


def test_save_and_load_preserve_the_encoding(tmp_path):
    tokenizer = train_tokenizer(texts=SAMPLES * 50, config=TokenizerTrainingConfig(vocab_size=300))
    path = tokenizer.save(tmp_path)
    assert path.name == "tokenizer.json"
    loaded = load_tokenizer(tmp_path)
    for text in SAMPLES:
        assert loaded.encode(text) == tokenizer.encode(text)
    assert load_tokenizer(path).stop_token_ids == tokenizer.stop_token_ids


def test_bad_tokenizer_inputs_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="No tokenizer file"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="leaves no room for merges"):
        TokenizerTrainingConfig(vocab_size=200)


def test_training_on_a_capped_corpus_is_deterministic():
    config = TokenizerTrainingConfig(vocab_size=600, corpus=CorpusConfig(max_bytes=100_000))
    first, second = train_tokenizer_on_corpus(config), train_tokenizer_on_corpus(config)
    assert first.to_json() == second.to_json()
