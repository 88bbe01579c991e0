"""Tiny random Hugging Face models of every supported family, built and saved locally (no download)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

COMMON = {
    "vocab_size": 300,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.1,
}
MOE = {"num_experts_per_tok": 2}


def family_configs() -> dict[str, object]:
    """model_type -> a tiny transformers config exercising the family's options."""
    return {
        "llama": transformers.LlamaConfig(
            **COMMON, intermediate_size=96, tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        ),
        "qwen2": transformers.Qwen2Config(**COMMON, intermediate_size=96, rope_theta=1000.0),
        "qwen3": transformers.Qwen3Config(**COMMON, intermediate_size=96, head_dim=32, tie_word_embeddings=True),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **COMMON, **MOE, intermediate_size=96, moe_intermediate_size=32, num_experts=4, head_dim=16,
            norm_topk_prob=True,
        ),
        "olmoe": transformers.OlmoeConfig(**COMMON, **MOE, intermediate_size=32, num_experts=4, clip_qkv=8.0),
        "mixtral": transformers.MixtralConfig(
            **COMMON, **MOE, intermediate_size=32, num_local_experts=4, sliding_window=None
        ),
        **deepseek_configs(),
    }


def deepseek_configs() -> dict[str, object]:
    """Two tiny DeepSeek-V3s: low-rank queries, interleaved rope, yarn scaling, 4 groups of 2 experts (top-2
    groups), a dense first layer and a shared expert; and a full query projection, plain rope, no groups,
    unnormalised gates and values wider than the query/key heads."""
    common = {**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4, "intermediate_size": 96,
              "moe_intermediate_size": 32, "num_experts_per_tok": 2, "kv_lora_rank": 16, "qk_rope_head_dim": 8}
    return {
        "deepseek_v3": transformers.DeepseekV3Config(
            **common, n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=12,
            rope_interleave=True, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
                "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1},
        ),
        "deepseek_v3_full_q": transformers.DeepseekV3Config(
            **common, n_routed_experts=4, n_shared_experts=2, n_group=1, topk_group=1, first_k_dense_replace=0,
            routed_scaling_factor=1.0, norm_topk_prob=False, q_lora_rank=None, qk_nope_head_dim=8, v_head_dim=24,
            rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        ),
    }


DEEPSEEK_CASES = ("deepseek_v3", "deepseek_v3_full_q")
MOE_FAMILIES = ("qwen3_moe", "olmoe", "mixtral", *DEEPSEEK_CASES)
ALL_FAMILIES = tuple(family_configs())


def build_hf_model(model_type: str, seed: int = 0):
    """A random transformers model of the family in fp32, eval mode."""
    torch.manual_seed(seed)
    config = family_configs()[model_type]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # DeepSeek's expert score bias starts at zero: make it change some choices
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model.eval()


def padded_batch(vocab: int, lengths=(11, 7, 3), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [B, T] and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), longest), generator=generator)
    mask = (torch.arange(longest)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


# A Qwen2.5-style template with Hermes tool calls (the shape of the real one, much shorter).
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0].content if messages[0].role == 'system' else "
    "'You are a helpful assistant.' }}\n\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}"
    "{% endfor %}\n</tools>\nReturn calls as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>"
    "<|im_end|>\n{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'system' %}{%- continue %}{%- endif %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- if message.content %}{{ message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")

# DeepSeek-V3's template (tokenizer_config.json of deepseek-ai/DeepSeek-V3), shortened: system prompts joined,
# the tool-call and tool-output tokens, arguments concatenated as JSON text. The real one does not render
# tool schemas; this one lists them in the system prompt (as V3.1's does) so the prompt shows them.
DEEPSEEK_TEMPLATE = (
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}{% if tools %}\n\n## Tools\n{% for tool in tools %}"
    "{{ tool['function'] | tojson }}\n{% endfor %}{% endif %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}"
    "{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜>"
    "<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + "
    "'\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}"
    "{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- set ns.is_output_first = false %}{%- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}"
    "{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)
DEEPSEEK_SPECIAL = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
DEEPSEEK_SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
)


def write_tokenizer_files(directory, chat_template: str = QWEN_TEMPLATE, *, deepseek: bool = False) -> None:
    """A byte-level tokenizer (256 byte tokens, no merges, the special tokens above, or DeepSeek's with
    deepseek=True) with the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(DEEPSEEK_SPECIAL_TOKENS if deepseek else SPECIAL_TOKENS))
    special = ({"bos_token": DEEPSEEK_SPECIAL["bos_token"], "eos_token": DEEPSEEK_SPECIAL["eos_token"]} if deepseek
               else {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
    fast.chat_template = chat_template
    fast.save_pretrained(directory)


def save_hf_directory(model_type: str, directory, seed: int = 0):
    """Save a tiny random model of the family with tokenizer files; returns the transformers model."""
    model = build_hf_model(model_type, seed)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer_files(directory)
    return model
