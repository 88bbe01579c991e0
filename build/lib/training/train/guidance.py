"""Expert guidance: a verified expert solution joins a GRPO group in which every rollout failed.

A group whose rollouts all fail has no advantage anywhere, so it teaches GRPO nothing; on the toy tier
about a third of an hour's groups end that way (mostly off-by-one and operator-swap bugs). With guidance
the scripted expert (training.train.scripted_expert) solves the same task in the same kind of sandbox,
through the same agent loop and tool format as the rollouts, and its trajectory joins the group as one
more member with the hidden-test reward it earned. The group then has a success: the expert sample gets
a positive advantage and the failed rollouts a small negative one, as if the policy had sampled it.

The expert's tokens were not sampled by the behaviour policy, so there are no recorded logprobs to form
an importance ratio with. They are scored by the learner itself just before the update (a no-grad
forward of the weights the update starts from): the ratio is then exactly 1 and the update is the plain
policy gradient advantage * grad log p(expert tokens), an advantage-weighted SFT step on the fix. This
is the "mixed-policy" idea of LUFFY (Yan et al., 2025, off-policy guidance on hard prompts), without its
policy-shaping of the off-policy tokens' probabilities.
"""

from __future__ import annotations

import torch

from sandboxes.tools import openai_tool_schemas
from training.chat_format import encode_assistant_completion, encode_messages
from training.model.transformer import MoETransformer
from training.tokenizer import BPETokenizer
from training.train.rollouts import RolloutRecord, Segment

EXPERT_STATUS = "expert guidance"
"""RolloutRecord.status of an expert member (it is trained on, never logged as a sampled rollout)."""


def expert_segments(*, messages: list[dict], tokenizer: BPETokenizer) -> list[Segment]:
    """One segment per assistant message, tokenized exactly as the served model meets the conversation.

    The prompt is the conversation before the message with the agent loop's tool schemas and the
    generation prompt (training.serving encodes requests the same way); the completion is what the model
    would generate, ending where generation stops (after a tool-call block, or at the end of the turn).
    Logprobs are left empty: expert_record_create fills them in with the learner's own.
    """
    tools = openai_tool_schemas()
    segments = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        completion = encode_assistant_completion(tokenizer, message)
        if tokenizer.tool_calls_end_id in completion:
            completion = completion[: completion.index(tokenizer.tool_calls_end_id) + 1]
        segments.append(
            Segment(
                prompt_token_ids=encode_messages(tokenizer, messages[:index], tools),
                token_ids=completion,
                logprobs=[],
                routed_experts=None,
            )
        )
    if not segments:
        raise ValueError("the expert trajectory has no assistant message to learn from")
    return segments


def expert_record_create(
    *,
    task_id: str,
    group: int,
    messages: list[dict],
    reward: float,
    tokenizer: BPETokenizer,
    model: MoETransformer,
    temperature: float,
) -> RolloutRecord:
    """The expert trajectory as a GRPO group member whose behaviour logprobs are `model`'s own.

    `model` must be the learner's weights as the coming update starts from them, at the rollout
    temperature, so that the update's importance ratio on these tokens is exactly 1.
    """
    from training.train.rl import segment_logprobs, segments_to_batches

    segments = expert_segments(messages=messages, tokenizer=tokenizer)
    record = RolloutRecord(
        task_id=task_id, group=group, valid=True, reward=reward, passed=True, segments=segments,
        status=EXPERT_STATUS, turns=len(segments) - 1,
    )
    for segment in segments:
        segment.logprobs = [0.0] * len(segment.token_ids)
    # Rows merged and unrouted as the update builds them (one forward for the shared prefix, and the same
    # numbers the update will compute); the loss positions run through the segments in order.
    batches = segments_to_batches(
        records=[record], advantages=torch.ones(1), micro_batch_size=1, pad_id=tokenizer.pad_id,
        with_routing=False,
    )
    with torch.no_grad():
        learner_logprobs = torch.cat([
            segment_logprobs(model, batch, temperature=temperature, routing_replay=False)[batch.loss_mask.bool()]
            for batch in batches
        ]).tolist()
    offset = 0
    for segment in segments:
        segment.logprobs = learner_logprobs[offset : offset + len(segment.token_ids)]
        offset += len(segment.token_ids)
    return record
