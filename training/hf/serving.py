"""Serving an imported model: the built-in ChatModel (engine worker, streaming, weight updates) with the
model's own chat template, tokenizer and tool-call syntax."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from training.engine import EngineConfig, GenerationResult
from training.hf.chat import (
    DEEPSEEK_START,
    HERMES_START,
    MISTRAL_START,
    HFChatFormat,
    HFToolCallParseError,
    load_tokenizer,
)
from training.hf.directory import GENERATION_CONFIG_FILE
from training.hf.loading import load_hf_model
from training.serving import ChatCompletion, ChatModel, shared_chat_model

DEFAULT_CONTEXT = 4096
"""Context an imported model is served with (KV cache per slot), unless its own is shorter."""



def stop_token_ids(directory: Path, tokenizer, chat: HFChatFormat) -> tuple[int, ...]:
    """The eos token of tokenizer_config.json plus generation_config.json's eos_token_id(s)."""
    ids: list[int] = []
    eos = chat.special_tokens.get("eos_token")
    if eos and tokenizer.token_to_id(eos) is not None:
        ids.append(tokenizer.token_to_id(eos))
    path = directory / GENERATION_CONFIG_FILE
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
        ids += [value] if isinstance(value, int) else [v for v in value or () if isinstance(v, int)]
    return tuple(dict.fromkeys(ids))


class HFChatModel(ChatModel):
    """A registered Hugging Face model answering chat requests (thread-safe, continuous batching)."""

    def __init__(self, directory: str | Path, *, name: str, engine_config: EngineConfig | None = None,
                 device: str | torch.device = "cpu", context: int = DEFAULT_CONTEXT) -> None:
        self.directory = Path(directory)
        self.chat = HFChatFormat.from_directory(self.directory)
        self.hf_tokenizer = load_tokenizer(self.directory)
        self.stop_ids = stop_token_ids(self.directory, self.hf_tokenizer, self.chat)
        model, _, _ = load_hf_model(self.directory, dtype=torch.float32, device=device)
        config = engine_config or EngineConfig(max_seq_len=min(context, model.config.max_seq_len))
        super().__init__(model, None, name=name, engine_config=config, copy_constraint=False)

    @classmethod
    def from_model(cls, model, tokenizer, *, name: str, engine_config: EngineConfig | None = None) -> HFChatModel:
        """Serve an in-memory policy with an imported model's tokenizer (training.hf.policy.HFTokenizer): the
        RL loops' rollout copy and the inference actors."""
        chat_model = cls.__new__(cls)
        chat_model.directory = None
        chat_model.chat = tokenizer.chat
        chat_model.hf_tokenizer = tokenizer.backend
        chat_model.stop_ids = tuple(tokenizer.stop_token_ids)
        config = engine_config or EngineConfig(max_seq_len=min(DEFAULT_CONTEXT, model.config.max_seq_len))
        ChatModel.__init__(chat_model, model, None, name=name, engine_config=config, copy_constraint=False)
        return chat_model

    @classmethod
    def shared(cls, directory: str | Path, name: str | None = None,  # type: ignore[override]
               context: int = DEFAULT_CONTEXT) -> HFChatModel:
        """One HFChatModel per model directory per process, reloaded when its config.json changes.
        context: longest prompt + completion (capped by the model's own), see HFChatModel.__init__."""
        chat_model = shared_chat_model(Path(directory), kind="hf",
                                       build=lambda path: cls(path, name=name or path.name, context=context))
        assert isinstance(chat_model, HFChatModel)
        return chat_model

    def _prompt_ids(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        text = self.chat.render(messages, tools=tools, add_generation_prompt=True)
        return self.hf_tokenizer.encode(text, add_special_tokens=False).ids

    def _stop_token_ids(self) -> Sequence[int]:
        return self.stop_ids

    def _tokenizer_backend(self):
        return self.hf_tokenizer

    def _decode(self, token_ids: list[int]) -> str:
        stops = set(self.stop_ids)
        return self.hf_tokenizer.decode([t for t in token_ids if t not in stops], skip_special_tokens=False)

    def _visible_content(self, token_ids: list[int]) -> str:
        text = self._decode(token_ids)
        for marker in (HERMES_START, MISTRAL_START, DEEPSEEK_START):
            text = text.split(marker, 1)[0]
        return text

    def _completion(self, result: GenerationResult) -> ChatCompletion:
        text = self._decode(result.token_ids)
        parse_error = None
        try:
            content, tool_calls = self.chat.parse(text)
        except HFToolCallParseError as error:
            content, tool_calls, parse_error = text, [], str(error)
        finish_reason = "length" if result.finish_reason == "length" else ("tool_calls" if tool_calls else "stop")
        return ChatCompletion(
            content=content, tool_calls=tool_calls, prompt_tokens=len(result.prompt_token_ids),
            completion_tokens=len(result.token_ids), token_ids=result.token_ids, logprobs=result.logprobs,
            routed_experts=result.routed_experts, finish_reason=finish_reason,
            prompt_token_ids=result.prompt_token_ids, parse_error=parse_error,
            weights_version=self.weights_version, sampling_masks=result.sampling_masks,
        )
