"""ChatModel.stream_choices: n independent seeded samples of one prompt, per-token logprobs in the deltas,
token bytes for OpenAI's logprobs."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from training.checkpoint import create_random_checkpoint
from training.engine import EngineConfig
from training.serving import ChatCompletion, ChatDelta, ChatModel, choice_seed

torch.set_num_threads(1)
MESSAGES = [{"role": "system", "content": "You fix code."}, {"role": "user", "content": "Run the tests."}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    checkpoint = create_random_checkpoint(tmp_path_factory.mktemp("ckpt"), size="tiny", seed=1, max_seq_len=512)
    chat_model = ChatModel.load(checkpoint, engine_config=EngineConfig(max_batch_size=4))
    yield chat_model
    chat_model.close()


def _choices(chat_model, **arguments) -> tuple[list[ChatCompletion], list[ChatDelta]]:
    items = list(chat_model.stream_choices(messages=MESSAGES, max_tokens=12, temperature=1.0, **arguments))
    completions = sorted((i for i in items if isinstance(i, ChatCompletion)), key=lambda c: c.index)
    return completions, [i for i in items if isinstance(i, ChatDelta)]


def test_n_choices_are_independent_seeded_samples(chat_model):
    completions, _ = _choices(chat_model, n=5, seed=7)
    assert [c.index for c in completions] == list(range(5))
    sequences = [tuple(c.token_ids) for c in completions]
    assert len(set(sequences)) == 5  # different samples, not one sample copied
    again, _ = _choices(chat_model, n=5, seed=7)
    assert [tuple(c.token_ids) for c in again] == sequences  # seeded: reproducible
    single, _ = _choices(chat_model, n=1, seed=7)
    assert single[0].token_ids == completions[0].token_ids  # choice 0 is the n=1 answer
    # choice i is exactly the single request seeded choice_seed(7, i): nothing couples the choices
    third, _ = _choices(chat_model, n=1, seed=choice_seed(7, 3))
    assert third[0].token_ids == completions[3].token_ids
    assert len({choice_seed(7, i) for i in range(16)}) == 16


def test_deltas_carry_every_token_with_its_top_logprobs(chat_model):
    completions, deltas = _choices(chat_model, n=2, seed=3, top_logprobs=4)
    for completion in completions:
        mine = [d for d in deltas if d.index == completion.index]
        tokens = [t for d in mine for t in d.tokens]
        assert [t.token_id for t in tokens] == completion.token_ids
        assert [t.logprob for t in tokens] == completion.logprobs
        assert [t.top for t in tokens] == completion.top_logprobs
        assert all(len(t.top) == 4 for t in tokens)
        assert "".join(d.text for d in mine) == completion.content or completion.tool_calls or completion.parse_error


def test_n_is_bounded(chat_model):
    for bad in (0, 17):
        with pytest.raises(ValueError, match="n must be in"):
            next(chat_model.stream_choices(messages=MESSAGES, n=bad))


def test_token_bytes_rebuild_the_generated_text(chat_model):
    completions, _ = _choices(chat_model, n=1, seed=5)
    token_bytes = chat_model.token_bytes()
    raw = b"".join(token_bytes.bytes_of(t) for t in completions[0].token_ids)
    assert raw.decode("utf-8", errors="replace") == chat_model.tokenizer.decode(completions[0].token_ids)
