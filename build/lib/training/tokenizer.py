"""Byte-level BPE tokenizer (HF `tokenizers`) trained on the code corpus, with chat special tokens."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training.corpus import CorpusConfig, iter_documents

PAD = "<|pad|>"
END_OF_TEXT = "<|endoftext|>"
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"
TOOLS_START = "<|tools|>"
TOOLS_END = "<|/tools|>"
TOOL_CALLS_START = "<|tool_calls|>"
TOOL_CALLS_END = "<|/tool_calls|>"

SPECIAL_TOKENS: tuple[str, ...] = (
    PAD,
    END_OF_TEXT,
    TURN_START,
    TURN_END,
    TOOLS_START,
    TOOLS_END,
    TOOL_CALLS_START,
    TOOL_CALLS_END,
)
TOKENIZER_FILE = "tokenizer.json"
# Enough text for a 2k-32k vocabulary to converge while training in a few seconds on one core.
DEFAULT_TOKENIZER_CORPUS_BYTES = 3_000_000


class TokenizerError(ValueError):
    """A tokenizer file that cannot serve the chat template."""


@dataclass
class TokenizerTrainingConfig:
    """How to train the BPE vocabulary."""

    vocab_size: int = 2048
    """Target vocabulary including the 256 byte symbols and the special tokens."""

    min_frequency: int = 2
    """Pairs seen fewer times than this are never merged."""

    corpus: CorpusConfig | None = None
    """Corpus to read; None means the stdlib capped at DEFAULT_TOKENIZER_CORPUS_BYTES."""

    def __post_init__(self) -> None:
        floor = 256 + len(SPECIAL_TOKENS)
        if self.vocab_size <= floor:
            raise ValueError(
                f"vocab_size={self.vocab_size} leaves no room for merges: it must exceed the 256 byte "
                f"symbols plus {len(SPECIAL_TOKENS)} special tokens ({floor})."
            )
        if self.min_frequency < 1:
            raise ValueError("min_frequency must be >= 1.")


class BPETokenizer:
    """Thin typed wrapper over a `tokenizers.Tokenizer` with the ids the engine and template need."""

    def __init__(self, backend: Tokenizer) -> None:
        self.backend = backend
        # A twin that reads special-token text as ordinary characters, for untrusted content.
        self._plain_backend = Tokenizer.from_str(backend.to_str())
        self._plain_backend.encode_special_tokens = True
        missing = [token for token in SPECIAL_TOKENS if backend.token_to_id(token) is None]
        if missing:
            raise TokenizerError(
                f"Tokenizer lacks the chat special tokens {missing}; retrain it with train_tokenizer."
            )
        self.pad_id = self.token_id(PAD)
        self.end_of_text_id = self.token_id(END_OF_TEXT)
        self.turn_start_id = self.token_id(TURN_START)
        self.turn_end_id = self.token_id(TURN_END)
        self.tool_calls_start_id = self.token_id(TOOL_CALLS_START)
        self.tool_calls_end_id = self.token_id(TOOL_CALLS_END)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Generation of an assistant turn ends at the end of a tool-call block or of the turn."""
        return (self.turn_end_id, self.tool_calls_end_id, self.end_of_text_id)

    def token_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"Token {token!r} is not in the vocabulary.")
        return token_id

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of text; allow_special=False encodes "<|im_end|>"-like text as plain characters."""
        backend = self.backend if allow_special else self._plain_backend
        return backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        return self.backend.to_str()

    def save(self, path: str | Path) -> Path:
        """Write tokenizer.json (into `path` if it is a directory), atomically."""
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(self.to_json())
        os.replace(temporary, path)
        return path


def load_tokenizer(path: str | Path) -> BPETokenizer:
    """Load a tokenizer.json file, or the tokenizer.json inside a checkpoint directory."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"No tokenizer file at {path}; train one with training.tokenizer.train_tokenizer."
        )
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception on malformed JSON
        raise TokenizerError(f"{path} is not a valid tokenizer.json: {error}") from error
    return BPETokenizer(backend)


def train_tokenizer(*, texts: Iterable[str], config: TokenizerTrainingConfig) -> BPETokenizer:
    """Train byte-level BPE on `texts`; special tokens get the first ids (pad is 0)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(backend)


def train_tokenizer_on_corpus(config: TokenizerTrainingConfig) -> BPETokenizer:
    corpus = config.corpus or CorpusConfig(max_bytes=DEFAULT_TOKENIZER_CORPUS_BYTES)
    return train_tokenizer(texts=(document.text for document in iter_documents(corpus)), config=config)


@functools.lru_cache(maxsize=8)
def _default_tokenizer_json(vocab_size: int) -> str:
    return train_tokenizer_on_corpus(TokenizerTrainingConfig(vocab_size=vocab_size)).to_json()


def default_tokenizer(vocab_size: int) -> BPETokenizer:
    """Tokenizer trained on the capped stdlib corpus, memoised per process (tests build many checkpoints)."""
    return BPETokenizer(Tokenizer.from_str(_default_tokenizer_json(vocab_size)))
