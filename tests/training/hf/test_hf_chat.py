"""The model's own chat template renders conversations; tool calls round-trip through each syntax."""

from __future__ import annotations

import json

import pytest

from tests.training.hf.hf_models import (
    DEEPSEEK_SPECIAL,
    DEEPSEEK_TEMPLATE,
    QWEN_TEMPLATE,
    write_tokenizer_files,
)
from training.hf.chat import (
    HFChatFormat,
    HFToolCallParseError,
    TemplateRenderError,
    ToolCallStream,
    load_tokenizer,
)

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}{% if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{% elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{% elif message.role == 'assistant' %}{% if message.tool_calls %}[TOOL_CALLS]["
    "{% for call in message.tool_calls %}{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "{% else %}{{ message.content }}{% endif %}{{ eos_token }}{% endif %}{% endfor %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Fix the bug in a.py"}]
REPLY = {"role": "assistant", "content": "Let me look.", "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "read_file", "arguments": json.dumps({"path": "a.py"})}},
    {"id": "call_2", "type": "function",
     "function": {"name": "read_file", "arguments": json.dumps({"path": "b/ü.py", "lines": [1, 2]})}},
]}


def formats() -> dict[str, HFChatFormat]:
    return {
        "hermes": HFChatFormat(template=QWEN_TEMPLATE, special_tokens={"eos_token": "<|im_end|>"},
                               tool_style="hermes"),
        "mistral": HFChatFormat(template=MISTRAL_TEMPLATE, special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
                                tool_style="mistral"),
        "deepseek": HFChatFormat(template=DEEPSEEK_TEMPLATE, special_tokens=DEEPSEEK_SPECIAL, tool_style="deepseek"),
    }


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("style", ["hermes", "mistral", "deepseek"])
def test_render_then_parse_round_trips_tool_calls(style):
    chat = formats()[style]
    prompt = chat.render(CONVERSATION, tools=TOOLS)
    assert "read_file" in prompt and "Fix the bug in a.py" in prompt
    completion = chat.render_assistant(CONVERSATION, REPLY, tools=TOOLS)
    content, calls = chat.parse(completion)
    assert _calls(calls) == _calls(REPLY["tool_calls"])
    assert content == ("" if style == "mistral" else REPLY["content"])
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in calls)


@pytest.mark.parametrize("style", ["hermes", "mistral", "deepseek"])
def test_streaming_parse_equals_whole_parse_for_every_split(style):
    chat = formats()[style]
    completion = chat.render_assistant(CONVERSATION, REPLY, tools=TOOLS)
    whole_content, whole_calls = chat.parse(completion)
    for size in (1, 2, 3, 7, len(completion)):
        stream = ToolCallStream(chat)
        streamed = "".join(stream.feed(completion[i:i + size]) for i in range(0, len(completion), size))
        rest, calls = stream.finish()
        assert streamed + rest == whole_content
        assert _calls(calls) == _calls(whole_calls)


def test_streaming_plain_text_is_passed_through_and_partial_marker_held():
    chat = formats()["hermes"]
    stream = ToolCallStream(chat)
    assert stream.feed("Hello <tool") == "Hello"
    assert stream.feed("box> ok") == " <toolbox> ok"
    assert stream.finish() == ("", [])


@pytest.mark.parametrize(("text", "message"), [
    ("x<tool_call>\n{\"name\": \"a\", \"arguments\": {}}", "not closed"),
    ("<tool_call>\n{nope}\n</tool_call>", "not valid JSON"),
    ("<tool_call>\n{\"arguments\": {}}\n</tool_call>", "needs a string \"name\""),
    ("<tool_call>\n{\"name\": \"a\", \"arguments\": [1]}\n</tool_call>", "must be a JSON object"),
])
def test_malformed_hermes_calls_are_refused(text, message):
    with pytest.raises(HFToolCallParseError, match=message):
        formats()["hermes"].parse(text)


def test_template_runs_sandboxed():
    hostile = HFChatFormat(template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateRenderError):
        hostile.render(CONVERSATION)
    mutating = HFChatFormat(template="{% set _ = messages.append(1) %}{{ messages | length }}")
    with pytest.raises(TemplateRenderError):
        mutating.render(CONVERSATION)
    raising = HFChatFormat(template="{{ raise_exception('no system role') }}")
    with pytest.raises(TemplateRenderError, match="no system role"):
        raising.render(CONVERSATION)


def test_from_directory_matches_transformers_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_tokenizer_files(tmp_path)
    chat = HFChatFormat.from_directory(tmp_path)
    assert chat.tool_style == "hermes" and chat.special_tokens["eos_token"] == "<|im_end|>"
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [*CONVERSATION, {**REPLY, "tool_calls": [
        {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
        for call in REPLY["tool_calls"]]}, {"role": "tool", "content": "print(1)"}]
    expected = reference.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert chat.render(messages, tools=TOOLS) == expected
    tokenizer = load_tokenizer(tmp_path)
    ids = tokenizer.encode(expected, add_special_tokens=False).ids
    assert tokenizer.token_to_id("<|im_start|>") in ids and tokenizer.decode(ids, skip_special_tokens=False) == expected


def test_deepseek_rendering_is_the_tool_call_token_syntax():
    chat = formats()["deepseek"]
    completion = chat.render_assistant(CONVERSATION, REPLY, tools=TOOLS)
    assert completion == (
        "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n```json\n"
        '{"path": "a.py"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n```json\n'
        '{"path": "b/\\u00fc.py", "lines": [1, 2]}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
    )
    # arguments given as objects are rendered as JSON text, as the template concatenates them
    as_objects = {**REPLY, "tool_calls": [{**call, "function": {**call["function"], "arguments": {"path": "a.py"}}}
                                          for call in REPLY["tool_calls"][:1]]}
    assert '```json\n{"path": "a.py"}\n```' in chat.render_assistant(CONVERSATION, as_objects, tools=TOOLS)
    prompt = chat.render([*CONVERSATION, REPLY, {"role": "tool", "content": "print(1)"}], tools=TOOLS)
    assert prompt.endswith("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>print(1)<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")


def test_deepseek_streaming_holds_a_partial_marker():
    stream = ToolCallStream(formats()["deepseek"])
    assert stream.feed("Sure <｜tool▁calls") == "Sure"
    assert stream.feed("▁begin｜><｜tool▁call▁begin｜>function") == ""
    stream.feed('<｜tool▁sep｜>ls\n```json\n{"dir": "."}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    rest, calls = stream.finish()
    assert rest == "" and _calls(calls) == [("ls", {"dir": "."})]


@pytest.mark.parametrize(("text", "message"), [
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{}\n```<｜tool▁call▁end｜>",
     "not closed"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{}\n```<｜tool▁calls▁end｜>",
     "Tool call 1 is not closed"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>retrieval<｜tool▁sep｜>a\n```json\n{}\n```<｜tool▁call▁end｜>"
     "<｜tool▁calls▁end｜>", "not valid JSON"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function a\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "lacks <｜tool▁sep｜>"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>[1]<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "must be a JSON object"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "must be a ```json block"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{x}\n```<｜tool▁call▁end｜>"
     "<｜tool▁calls▁end｜>", "not valid JSON"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>\n```json\n{}\n```<｜tool▁call▁end｜>"
     "<｜tool▁calls▁end｜>", "needs a string \"name\""),
    ("<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>", "holds no calls"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{}\n```<｜tool▁call▁end｜>"
     "<｜tool▁calls▁end｜> and more", "calls must end the turn"),
])
def test_malformed_deepseek_calls_are_refused(text, message):
    with pytest.raises(HFToolCallParseError, match=message):
        formats()["deepseek"].parse(text)


def test_deepseek_style_is_chosen_from_template_or_tokenizer(tmp_path):
    write_tokenizer_files(tmp_path, chat_template=DEEPSEEK_TEMPLATE)
    assert HFChatFormat.from_directory(tmp_path).tool_style == "deepseek"
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    reference.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # shows no tool syntax
    reference.add_special_tokens({"additional_special_tokens": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"]})
    reference.save_pretrained(tmp_path)
    assert HFChatFormat.from_directory(tmp_path).tool_style == "deepseek"


def test_deepseek_v31_calls_without_type_and_fence_are_parsed():
    """DeepSeek-V3.1 writes `NAME<｜tool▁sep｜>{json}` between the same tokens; both layouts parse."""
    text = ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>{"path": "a.py"}<｜tool▁call▁end｜>'
            '<｜tool▁call▁begin｜>function<｜tool▁sep｜>{"x": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')
    content, calls = formats()["deepseek"].parse(text)
    assert content == "Checking." and _calls(calls) == [("read_file", {"path": "a.py"}), ("function", {"x": 1})]
