"""Templates that render no tools get the Hermes tool format: schemas in the system prompt, calls and
results as text, parsed back the same way, identically for serving, SFT masking and the stream parser."""

from __future__ import annotations

import json

import pytest

from sandboxes.tools import openai_tool_schemas
from training.hf.chat import HFChatFormat, HFToolCallParseError, ToolCallStream

# The shape of SmolLM2-Instruct's template: role and content only, no tools section.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A template with its own tools section (Qwen-style): left as it is.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] or '' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "read_file", "arguments": json.dumps({"path": "calc.py"})}}
CONVERSATION = [
    {"role": "user", "content": "Fix calc.py"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "def add(a, b):\n    return a - b"},
]


def chat() -> HFChatFormat:
    return HFChatFormat(template=PLAIN_TEMPLATE, special_tokens={"eos_token": "<|im_end|>"})


def test_a_template_without_tools_gets_the_schemas_in_its_system_prompt():
    fmt = chat()
    assert (fmt.tools_in_template, fmt.tool_style) == (False, "hermes")
    tools = openai_tool_schemas()
    prompt = fmt.render(CONVERSATION, tools=tools)
    assert prompt.startswith("<|im_start|>system\n# Tools")
    assert "You are a helpful AI assistant" not in prompt  # our system turn replaces the default one
    for tool in tools:
        assert json.dumps(tool, ensure_ascii=False) in prompt
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "calc.py"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\ndef add(a, b):\n    return a - b\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_a_template_with_its_own_tools_section_is_left_as_it_is():
    fmt = HFChatFormat(template=TOOLS_TEMPLATE, tool_style="hermes")
    assert fmt.tools_in_template
    prompt = fmt.render([{"role": "user", "content": "hi"}], tools=openai_tool_schemas())
    assert prompt.startswith("<tools>") and "# Tools" not in prompt


def test_what_serving_renders_parses_back_to_the_same_call():
    fmt = chat()
    reply = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    # The text the model must write for this reply (what SFT trains on) parses back to the reply's call.
    text = fmt.render_assistant(CONVERSATION[:1], reply, tools=openai_tool_schemas())
    content, calls = fmt.parse(text)
    assert content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("read_file", {"path": "calc.py"})]
    # The stream parser holds the call back and returns it whole at the end, as the non-streamed parse does.
    stream = ToolCallStream(fmt)
    shown = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, streamed = stream.finish()
    assert shown + rest == "" and [c["function"] for c in streamed] == [c["function"] for c in calls]


def test_a_malformed_call_is_refused_with_the_reason():
    with pytest.raises(HFToolCallParseError, match="not closed"):
        chat().parse('<tool_call>\n{"name": "read_file", "arguments": {}}')
    with pytest.raises(HFToolCallParseError, match="not valid JSON"):
        chat().parse("<tool_call>\n{name: read_file}\n</tool_call>")


def test_sft_masking_trains_exactly_the_hermes_reply():
    from training.hf.sft import tokenize_hf_trajectory

    class CharTokenizer:
        """One id per character, enough to check which characters the loss mask covers."""

        def __init__(self, fmt):
            self.chat = fmt

        def encode(self, text):
            return [ord(ch) for ch in text]

    messages = [*CONVERSATION, {"role": "assistant", "content": "Done: add returns a + b now."}]
    example = tokenize_hf_trajectory(messages=messages, tools=openai_tool_schemas(), tokenizer=CharTokenizer(chat()))
    trained = "".join(chr(i) for i, m in zip(example.token_ids, example.trainable, strict=True) if m)
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "calc.py"}}\n</tool_call>' in trained
    assert "Done: add returns a + b now." in trained
    assert "<tool_response>" not in trained and "# Tools" not in trained
