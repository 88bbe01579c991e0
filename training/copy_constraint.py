"""Copy-constrained decoding: the text an edit replaces can only be text the agent has read.

`edit_file` replaces `old_str`, which must match the file exactly. The tiny policy knows which line it
wants to change but often miscopies it: on 60 validation tasks, 92 of 156 `edit_file` calls of
`models/sft` had an `old_str` that was not in the file (none only by whitespace; 42 had part of the fix
or a neighbouring number written into the copy, 50 were lines of other toy functions).

While the model writes the JSON string value of a copied argument (``old_str``) inside a tool-call
block, `CopyConstraint.allowed` masks every token that would make the string so far something that
does not occur in the conversation's tool results (with `read_file`'s line numbers taken off). The
model still chooses *where* to copy from and when to close the string; it only cannot invent text.
Grammar-constrained decoding of tool calls is what servers such as vLLM (guided decoding) and
llama.cpp (GBNF) do for JSON; this applies the same mechanism to one argument's content.

The check works on the JSON-escaped text, since that is what the tokens spell: every source is
escaped as the chat template escapes arguments (``json.dumps(..., ensure_ascii=False)``), and a token
is allowed when the part of it before an unescaped closing quote extends the partial string to a
substring of an escaped source (a closing quote is allowed once the string is non-empty). Candidate
tokens are found by walking each place the partial string occurs through a trie of the vocabulary's
token texts, so a step costs the number of occurrences times the longest token, not the vocabulary.

When no token would be allowed (no tool result yet, or the token that opened the string already
carried text that is in no source) the step is left unconstrained rather than forced into nonsense.

The engine records the logprob of each sampled token under the *masked* distribution it was drawn
from, and returns the masks (GenerationResult.sampling_masks). The RL learner applies the same masks
before its log-softmax, so the policy it trains is the constrained policy that was sampled (importance
ratio 1 on-policy): a forced token (one allowed) carries no gradient, and where several continuations
were allowed (which line to copy) the gradient only moves mass among them. Recording the unconstrained
logprob instead would train every forced copy token as if the model had chosen it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from training.tokenizer import BPETokenizer

COPIED_ARGUMENTS: tuple[str, ...] = ("old_str",)
"""Tool-call arguments whose value must be copied from what the agent has read."""

_NUMBERED_LINE = re.compile(r"^ *\d+\t", re.MULTILINE)
"""read_file's `cat -n` prefix (number_lines in sandboxes.tool_impl.text)."""


def copy_sources(messages: Iterable[dict[str, Any]]) -> list[str]:
    """Texts an argument may be copied from: every tool result in the conversation, line numbers removed."""
    sources = []
    for message in messages:
        if message.get("role") != "tool":
            continue
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if isinstance(content, str) and content:
            sources.append(_NUMBERED_LINE.sub("", content))
    return sources


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


@dataclass
class _TrieNode:
    children: dict[str, _TrieNode] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    """Tokens whose whole text is the path to this node."""


class CopyVocabulary:
    """What the constraint needs to know about a tokenizer's vocabulary; built once per tokenizer."""

    def __init__(self, tokenizer: BPETokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.tool_calls_start_id = tokenizer.tool_calls_start_id
        special = set(tokenizer.stop_token_ids) | {tokenizer.tool_calls_start_id, tokenizer.turn_start_id,
                                                   tokenizer.pad_id}
        self.texts: list[str] = []
        self.root = _TrieNode()
        self.closers: tuple[dict[str, list[int]], dict[str, list[int]]] = ({}, {})
        """[escape_pending][body] -> tokens spelling body + '"' + anything whose quote closes the string, when
        the text before the token ends in an even (0) or odd (1) number of backslashes."""
        self.longest = 1
        for token_id in range(self.vocab_size):
            text = "" if token_id in special else tokenizer.decode([token_id])
            self.texts.append(text)
            # partial UTF-8 bytes and control characters never occur in an escaped source
            if not text or "\ufffd" in text:
                continue
            self.longest = max(self.longest, len(text))
            node = self.root
            for char in text:
                node = node.children.setdefault(char, _TrieNode())
            node.token_ids.append(token_id)
            for escape_pending in (0, 1):
                quote = _first_unescaped_quote(text, escape_pending)
                if quote is not None:
                    self.closers[escape_pending].setdefault(text[:quote], []).append(token_id)


def _first_unescaped_quote(text: str, backslashes_before: int = 0) -> int | None:
    run = backslashes_before
    for index, char in enumerate(text):
        if char == '"' and run % 2 == 0:
            return index
        run = run + 1 if char == "\\" else 0
    return None


def _character_starts(escaped: str) -> list[bool]:
    """Whether each position of an escaped string starts a character (is not inside an escape like \\n)."""
    starts = [True] * (len(escaped) + 1)
    at = 0
    while at < len(escaped):
        if escaped[at] == "\\":
            width = 6 if escaped[at + 1 : at + 2] == "u" else 2
            for inside in range(at + 1, min(at + width, len(escaped))):
                starts[inside] = False
            at += width
        else:
            at += 1
    return starts


def _trailing_backslashes(text: str) -> int:
    return len(text) - len(text.rstrip("\\"))


class CopyConstraint:
    """Per-request state: which tokens may follow, given the tokens generated so far."""

    def __init__(self, vocabulary: CopyVocabulary, sources: Sequence[str],
                 arguments: Sequence[str] = COPIED_ARGUMENTS) -> None:
        self.vocabulary = vocabulary
        self.sources = [_escaped(source) for source in sources if source]
        self._boundaries = [_character_starts(source) for source in self.sources]
        self.markers = [f'"{name}": "' for name in arguments]
        self._seen = 0
        self._in_block = False
        self._block_text = ""
        self.constrained_steps = 0
        """Steps at which a mask was applied (for tests and statistics)."""

    def allowed(self, generated: Sequence[int]) -> torch.Tensor | None:
        """Boolean mask [vocab] of the tokens allowed next, or None when this step is unconstrained."""
        vocabulary = self.vocabulary
        for token_id in generated[self._seen:]:
            if token_id == vocabulary.tool_calls_start_id:
                self._in_block, self._block_text = True, ""
            elif self._in_block:
                self._block_text += vocabulary.texts[token_id]
        self._seen = len(generated)
        if not self._in_block or not self.sources:
            return None
        partial = self._open_copied_string()
        if partial is None:
            return None
        allowed = self._allowed_ids(partial)
        if not allowed:
            return None
        mask = torch.zeros(vocabulary.vocab_size, dtype=torch.bool)
        mask[list(allowed)] = True
        self.constrained_steps += 1
        return mask

    def _open_copied_string(self) -> str | None:
        """The escaped text written so far into a copied argument whose string is still open."""
        text = self._block_text
        start = max((text.rfind(marker) + len(marker) if marker in text else -1) for marker in self.markers)
        if start < 0:
            return None
        partial = text[start:]
        if _first_unescaped_quote(partial) is not None:
            return None
        return partial

    def _allowed_ids(self, partial: str) -> set[int]:
        vocabulary = self.vocabulary
        allowed: set[int] = set()
        closers = vocabulary.closers[_trailing_backslashes(partial) % 2]
        walked: set[str] = set()
        for source, starts in zip(self.sources, self._boundaries, strict=True):
            if partial:
                ends, at = [], source.find(partial)
                while at != -1:
                    if starts[at]:
                        ends.append(at + len(partial))
                    at = source.find(partial, at + 1)
            else:
                ends = [at for at in range(len(source)) if starts[at]]
            for end in ends:
                continuation = source[end:end + vocabulary.longest]
                if continuation in walked:
                    continue
                walked.add(continuation)
                node, body = vocabulary.root, ""
                while True:
                    allowed.update(node.token_ids)
                    if partial or body:  # tokens whose quote closes the string right after `partial + body`
                        allowed.update(closers.get(body, ()))
                    if len(body) == len(continuation):
                        break
                    char = continuation[len(body)]
                    node = node.children.get(char)
                    if node is None:
                        break
                    body += char
        return allowed
