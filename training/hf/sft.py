"""SFT examples of an imported model: conversations rendered by its own chat template, loss on the assistant.

The trained tokens of an assistant turn are exactly what the model writes after the template's generation
prompt: the turn's text and tool calls (in the family's syntax) up to and including the end-of-turn token
(the tokenizer's eos). Whatever the template adds after that token (Qwen's newline before the next
``<|im_start|>``) and every other turn are context. Each piece is tokenized on its own at its template
boundary, as the model meets it when it generates (prompt encoded, completion sampled token by token), so
SFT rows and RL segments (prompt_token_ids + token_ids of the served model) have the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from training.hf.chat import TemplateRenderError
from training.hf.policy import HFTokenizer
from training.train.data import TokenizedExample


def assistant_completion(tokenizer: HFTokenizer, messages: Sequence[dict[str, Any]], reply: dict[str, Any],
                         tools: Sequence[dict[str, Any]] | None) -> tuple[str, str]:
    """(what the model writes for `reply`, the template's text after it) in the rendered conversation."""
    text = tokenizer.chat.render_assistant(messages, reply, tools=tools)
    eos = tokenizer.chat.special_tokens.get("eos_token")
    if eos and eos in text:
        end = text.index(eos) + len(eos)
        return text[:end], text[end:]
    return text, ""


def tokenize_hf_trajectory(
    *,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    tokenizer: HFTokenizer,
    context_loss: bool = False,
) -> TokenizedExample:
    """Token ids of the conversation as the model's template renders it, trainable on the assistant turns
    (an assistant message with ``"train": false`` is context); with context_loss the user and tool turns are
    trainable too (the first rendered piece, the system prompt with the tools, never is)."""
    token_ids: list[int] = []
    trainable: list[bool] = []
    rendered = ""

    def append(text: str, train: bool) -> None:
        ids = tokenizer.encode(text) if text else []
        token_ids.extend(ids)
        trainable.extend([train] * len(ids))

    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = tokenizer.chat.render(messages[:index], tools=tools, add_generation_prompt=True)
        if not prompt.startswith(rendered):
            raise TemplateRenderError(
                f"Message {index}: the model's template renders the earlier turns differently once more follow "
                "(e.g. it drops earlier reasoning); SFT needs a prefix-stable rendering."
            )
        completion, after = assistant_completion(tokenizer, messages[:index], message, tools)
        append(prompt[len(rendered):], context_loss and bool(rendered))
        append(completion, message.get("train", True) is not False)
        append(after, False)
        rendered = prompt + completion + after
    full = tokenizer.chat.render(messages, tools=tools, add_generation_prompt=False)
    if not full.startswith(rendered):
        raise TemplateRenderError("The rendered conversation does not extend its assistant turns; check the messages.")
    append(full[len(rendered):], context_loss and bool(rendered))
    return TokenizedExample(token_ids=token_ids, trainable=trainable)


def assistant_spans(tokenizer: HFTokenizer, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None) -> list[str]:
    """The text of every trainable assistant turn, as the template renders it (for checking masks)."""
    return [
        assistant_completion(tokenizer, messages[:index], message, tools)[0]
        for index, message in enumerate(messages)
        if message.get("role") == "assistant" and message.get("train", True) is not False
    ]
