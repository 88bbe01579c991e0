"""A tiny imported Qwen3-MoE policy for training tests: widths multiples of 32 (MXFP8 applies), a BPE
tokenizer trained here on the agent's prompt and tool schemas (so the agent's system prompt fits a few
thousand tokens), Qwen2.5's tool-calling chat template. Built and saved locally with transformers (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.training.hf.hf_models import SPECIAL_TOKENS

transformers = pytest.importorskip("transformers")

VOCAB = 1024

# Qwen2.5's tool-calling chat template (its structure and whitespace; the system text shortened).
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n    {{- \"\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools>"
    " XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n"
    "    {%- endfor %}\n    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and"
    " arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>,"
    " \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n"
    "{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)


def policy_config():
    """Qwen3-MoE: d_model 64 and expert width 32 (multiples of the MX block), 4 experts top-2, 8k context."""
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=8192, initializer_range=0.1, num_experts_per_tok=2,
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, norm_topk_prob=True,
    )


def _training_texts() -> list[str]:
    from sandboxes.tools import openai_tool_schemas
    from training.agent.loop import SYSTEM_PROMPT
    from training.tasks.toy import generate_toy_task

    tools = openai_tool_schemas()
    texts = [SYSTEM_PROMPT, QWEN25_TEMPLATE, *(json.dumps(tool, ensure_ascii=False) for tool in tools)]
    for seed in range(6):
        task = generate_toy_task(seed)
        texts.append(task.prompt)
        texts.extend(task.files.values() if isinstance(getattr(task, "files", None), dict) else ())
    return texts * 4


def write_policy_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer of VOCAB tokens trained on the agent's texts, with the Qwen template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_texts(), trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = QWEN25_TEMPLATE
    fast.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": fast.convert_tokens_to_ids("<|im_end|>")}))


def save_policy_directory(directory: Path, seed: int = 0):
    """Save the tiny policy (fp32) with its tokenizer files; returns the transformers model."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(policy_config(), dtype=torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)
    write_policy_tokenizer(directory)
    return model
