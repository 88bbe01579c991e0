"""Copy-constrained decoding of edit_file's old_str (training.copy_constraint) and its use by the engine."""

from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from training.checkpoint import create_random_checkpoint, load_checkpoint
from training.copy_constraint import CopyConstraint, CopyVocabulary, copy_sources
from training.engine import EngineConfig, GenerationEngine, SamplingParams
from training.serving import ChatModel
from training.tokenizer import load_tokenizer

torch.set_num_threads(1)

SFT_CHECKPOINT = "models/sft"
READ_RESULT = (
    "calc.py (lines 1-5 of 5)\n"
    '     1\tdef add(a, b):\n     2\t    if a > 0:\n     3\t        return a + b\n     4\t    return "x\\\\y"\n'
    "     5\t\n"
)
RAW_FILE = 'def add(a, b):\n    if a > 0:\n        return a + b\n    return "x\\\\y"\n\n'
OPEN_OLD_STR = '<|tool_calls|>\n{"name": "edit_file", "arguments": {"path": "calc.py", "old_str": "'


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SFT_CHECKPOINT)


@pytest.fixture(scope="module")
def vocabulary(tokenizer):
    return CopyVocabulary(tokenizer)


def _expected_allowed(vocabulary: CopyVocabulary, sources: list[str], partial: str) -> set[int]:
    """Brute force over the vocabulary: the tokens that keep `partial` a prefix of the escaped text of a
    substring of a source, or close the string right after such a (non-empty) substring."""
    prefixes, substrings = set(), set()
    for source in sources:
        for start in range(len(source)):
            escaped_tail = _escaped(source[start:])
            prefixes.update(escaped_tail[:cut] for cut in range(len(escaped_tail) + 1))
            substrings.update(_escaped(source[start:end]) for end in range(start + 1, len(source) + 1))
    expected = set()
    for token_id, text in enumerate(vocabulary.texts):
        if not text or "\ufffd" in text:
            continue
        written, closed = partial, False
        for char in text:
            backslashes = len(written) - len(written.rstrip("\\"))
            if char == '"' and backslashes % 2 == 0:
                closed = True
                break
            written += char
        if (closed and written in substrings) or (not closed and written in prefixes):
            expected.add(token_id)
    return expected


def _allowed_after(vocabulary, tokenizer, sources, written: str) -> set[int] | None:
    constraint = CopyConstraint(vocabulary, sources)
    mask = constraint.allowed(tokenizer.encode(OPEN_OLD_STR + written))
    return None if mask is None else set(mask.nonzero().flatten().tolist())


def test_sources_are_the_tool_results_without_read_file_line_numbers():
    messages = [
        {"role": "system", "content": "You fix code."},
        {"role": "user", "content": "    1\tnot a tool result"},
        {"role": "tool", "tool_call_id": "a", "content": READ_RESULT},
        {"role": "tool", "tool_call_id": "b", "content": "calc.py:3:        return a + b\n"},
    ]
    assert copy_sources(messages) == [
        "calc.py (lines 1-5 of 5)\n" + RAW_FILE,
        "calc.py:3:        return a + b\n",
    ]


@pytest.mark.parametrize("written", ["", "    if", "        return a + b", "        return a + b\\n", "    return \\",
                                     '    return \\"x\\\\', '    return \\"x\\\\\\\\y\\"', "a, b):\\n    if a > 0"])
def test_the_mask_is_exactly_the_tokens_that_keep_the_copy_inside_a_source(tokenizer, vocabulary, written):
    sources = copy_sources([{"role": "tool", "content": READ_RESULT}])
    allowed = _allowed_after(vocabulary, tokenizer, sources, written)
    assert allowed == _expected_allowed(vocabulary, sources, written)
    assert allowed, "every partial copy of the file can be continued or closed"


def test_no_mask_outside_the_copied_argument_or_when_nothing_can_follow(tokenizer, vocabulary):
    sources = copy_sources([{"role": "tool", "content": READ_RESULT}])
    # before the tool-call block, in another argument, and after old_str was closed
    for text in ['{"old_str": "', '<|tool_calls|>\n{"name": "edit_file", "arguments": {"path": "',
                 OPEN_OLD_STR + '    if a > 0:", "new_str": "']:
        assert CopyConstraint(vocabulary, sources).allowed(tokenizer.encode(text)) is None, text
    # text the model already wrote that is in no source: leave the step free rather than force nonsense
    assert _allowed_after(vocabulary, tokenizer, sources, "    return a - b") is None
    # no tool result yet
    assert CopyConstraint(vocabulary, []).allowed(tokenizer.encode(OPEN_OLD_STR)) is None


def test_the_constraint_follows_a_growing_generation_incrementally(tokenizer, vocabulary):
    sources = copy_sources([{"role": "tool", "content": READ_RESULT}])
    constraint = CopyConstraint(vocabulary, sources)
    generated = tokenizer.encode(OPEN_OLD_STR)
    for token_id in tokenizer.encode("        return a + b"):
        mask = constraint.allowed(generated)
        assert mask is not None and bool(mask[token_id])
        generated.append(token_id)
    close = tokenizer.encode('",')
    assert bool(constraint.allowed(generated)[close[0]])
    assert constraint.allowed(generated + close) is None
    assert constraint.constrained_steps == len(tokenizer.encode("        return a + b")) + 1


def test_engine_samples_only_allowed_tokens_and_records_the_masked_logprobs_and_masks():
    torch.manual_seed(0)
    model, _, _ = load_checkpoint(SFT_CHECKPOINT)
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=2, prefix_cache_size=0))

    class EvenTokens:
        def allowed(self, generated):
            mask = torch.zeros(model.config.vocab_size, dtype=torch.bool)
            mask[::2] = True
            return mask

    prompt = list(range(10, 40))
    constrained, free = engine.generate(
        [prompt, prompt],
        [SamplingParams(max_tokens=12, temperature=1.0, seed=3, constraint=EvenTokens()),
         SamplingParams(max_tokens=12, temperature=1.0, seed=3)],
    )
    assert all(token % 2 == 0 for token in constrained.token_ids)
    assert any(token % 2 for token in free.token_ids), "the unconstrained row is not masked by its neighbour"
    assert free.sampling_masks is None
    masks = constrained.sampling_masks
    assert masks.positions == list(range(len(constrained.token_ids)))
    assert masks.allowed.shape == (len(constrained.token_ids), model.config.vocab_size)
    assert bool(masks.allowed[:, ::2].all()) and not bool(masks.allowed[:, 1::2].any())
    with torch.no_grad():
        logits = model(torch.tensor([prompt + constrained.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    targets = torch.tensor(constrained.token_ids)[:, None]
    masked = logits.masked_fill(~masks.allowed, float("-inf")).log_softmax(-1).gather(1, targets).squeeze(1)
    unconstrained = logits.log_softmax(-1).gather(1, targets).squeeze(1)
    torch.testing.assert_close(torch.tensor(constrained.logprobs), masked, atol=2e-4, rtol=0)
    # removing half the vocabulary must raise every recorded probability (this is not the unconstrained logprob)
    assert bool((masked > unconstrained + 1e-3).all())


def _served_old_str(chat_model: ChatModel, seed: int) -> str:
    """Sample a continuation of an open old_str from the served model, as the agent loop would."""
    messages = [{"role": "user", "content": "Fix add."}, {"role": "tool", "content": READ_RESULT}]
    copy_constraint = chat_model._copy_constraint(messages)
    opening = chat_model.tokenizer.encode(OPEN_OLD_STR)

    class AfterOpening:
        """The model does not write the opening itself here: the constraint sees it as already generated."""

        def allowed(self, generated):
            return copy_constraint.allowed(opening + list(generated))

    [result] = GenerationEngine(chat_model.engine.model, config=EngineConfig(max_batch_size=1)).generate(
        [opening], SamplingParams(max_tokens=40, temperature=1.5, seed=seed, constraint=AfterOpening())
    )
    assert copy_constraint.constrained_steps >= 1
    text = chat_model.tokenizer.decode(result.token_ids)
    written = ""
    for char in text:
        if char == '"' and (len(written) - len(written.rstrip("\\"))) % 2 == 0:
            break
        written += char
    # a copy cut off mid-escape by max_tokens is still a prefix of one: drop the dangling backslash
    if (len(written) - len(written.rstrip("\\"))) % 2:
        written = written[:-1]
    return json.loads(f'"{written}"')


def test_a_random_model_can_only_copy_text_it_was_shown(tmp_path):
    checkpoint = create_random_checkpoint(tmp_path, size="tiny", seed=2, max_seq_len=512)
    # the random checkpoint's tokenizer differs from the SFT one; the constraint uses the served one
    chat_model = ChatModel.load(checkpoint, engine_config=EngineConfig(max_batch_size=1))
    try:
        copies = [_served_old_str(chat_model, seed) for seed in range(6)]
    finally:
        chat_model.close()
    shown = copy_sources([{"role": "tool", "content": READ_RESULT}])[0]
    assert all(copy in shown for copy in copies), copies
    assert any(len(copy) >= 3 for copy in copies), "the model was free to copy more than a character"


def test_chat_model_builds_the_constraint_only_when_enabled(tmp_path):
    checkpoint = create_random_checkpoint(tmp_path, size="tiny", seed=2, max_seq_len=512)
    messages = [{"role": "user", "content": "Fix add."}, {"role": "tool", "content": READ_RESULT}]
    enabled = ChatModel.load(checkpoint)
    disabled = ChatModel.load(checkpoint, copy_constraint=False)
    try:
        assert enabled.copy_constraint and not disabled.copy_constraint
        assert isinstance(enabled._copy_constraint(messages), CopyConstraint)
        assert enabled._copy_constraint(messages[:1]) is None
    finally:
        enabled.close()
        disabled.close()


def test_the_api_extension_lists_the_masks_as_token_ids():
    from training.engine import SamplingMasks
    from training.serving import ChatCompletion

    allowed = torch.zeros(2, 16, dtype=torch.bool)
    allowed[0, [3, 7]] = True
    allowed[1, 9] = True
    completion = ChatCompletion(content="", tool_calls=[], prompt_tokens=4, completion_tokens=5,
                                token_ids=[1, 3, 9, 2, 0], logprobs=[-0.5, -0.1, 0.0, -1.0, -0.2], routed_experts=None,
                                sampling_masks=SamplingMasks([1, 2], allowed))
    extension = json.loads(json.dumps(completion.flowstate_extension()))
    assert extension["sampling_masks"] == {"positions": [1, 2], "allowed_token_ids": [[3, 7], [9]]}
