"""A tiny Qwen3-MoE built with transformers whose weights are set by hand so that, after any chat prompt,
greedy or sampled, it answers with one Hermes tool call: ``<tool_call>{read_file README.md}</tool_call>``.

How: every attention output and expert down projection is zeroed, so the last hidden state is the
current token's embedding and the model is a bigram table; the output rows of the chain
``<last token of the generation prompt> -> <tool_call> -> CALL -> </tool_call> -> <|im_end|>`` are set to a
large multiple of the previous token's normalised embedding (a margin of ~100 nats). CALL is one added
(non-special) token holding the call's JSON, since a bigram table cannot spell JSON byte by byte. The
chat template, tokenizer and Hermes parsing are the model's own, as for any imported model; only the
weights are not random. Test-only: nothing in the product biases a model.
"""

from __future__ import annotations

import json

import torch

from tests.training.hf.hf_models import QWEN_TEMPLATE, SPECIAL_TOKENS, transformers

CALL = json.dumps({"name": "read_file", "arguments": {"path": "README.md"}})
MARGIN = 25.0
"""Logit of the next chain token per unit of the normalised hidden state's norm (sqrt(hidden) = 8)."""


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.add_tokens([CALL])
    return tokenizer


def save_tool_calling_model(directory, *, seed: int = 0):
    """Save the model, tokenizer and template to `directory`; returns the transformers model."""
    tokenizer = _tokenizer()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = QWEN_TEMPLATE
    # the generation prompt's last token ("t" of "<|im_start|>assistant": the template strips the newline)
    prompt = fast.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    chain = [tokenizer.encode(prompt, add_special_tokens=False).ids[-1], *(tokenizer.token_to_id(t) for t in (
        "<tool_call>", CALL, "</tool_call>", "<|im_end|>"))]
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8192, initializer_range=0.1, num_experts_per_tok=2, intermediate_size=96,
        moe_intermediate_size=32, num_experts=4, head_dim=16, norm_topk_prob=True, tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                parameter.zero_()
        embeddings = model.get_input_embeddings().weight
        output = model.get_output_embeddings().weight
        for current, following in zip(chain, chain[1:], strict=False):
            hidden = model.model.norm(embeddings[current])
            output[following] = MARGIN * hidden / hidden.norm()
    model.save_pretrained(directory, safe_serialization=True)
    fast.save_pretrained(directory)
    return model
