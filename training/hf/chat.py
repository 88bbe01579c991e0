"""Chat format of an imported model: its own Jinja chat template, its own tool-call syntax.

Messages and tool schemas are rendered with the template from tokenizer_config.json in Jinja's
ImmutableSandboxedEnvironment, configured as transformers does (trim_blocks, lstrip_blocks, loop
controls, `tojson`, `raise_exception`, `strftime_now`), so a hostile template can neither reach Python
objects nor mutate the messages. Generated text is split into content and OpenAI `tool_calls` by the
family's syntax: Hermes/Qwen `<tool_call>{json}</tool_call>` blocks, Mistral `[TOOL_CALLS][...]`, or
DeepSeek-V3's tool-call tokens (`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`,
a ```json block, `<｜tool▁call▁end｜>`, ... `<｜tool▁calls▁end｜>`; V3.1's `NAME<｜tool▁sep｜>{json}` too).

A template that renders no tools (many small instruct models' templates only join role and content) gets
them in one standard format instead, the Hermes format Qwen and NousResearch models use: the schemas as
JSON lines inside `<tools></tools>` in the system prompt, the assistant's calls as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, tool results as a user turn of
`<tool_response>...</tool_response>` blocks; generations are parsed back the same way. Serving, the agent
loop, SFT masking and RL segments all render and parse through HFChatFormat, so they agree on it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from training.hf.directory import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, read_chat_template

ToolStyle = Literal["hermes", "mistral", "deepseek", "none"]
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
MISTRAL_START = "[TOOL_CALLS]"
DEEPSEEK_START, DEEPSEEK_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_START, DEEPSEEK_CALL_END, DEEPSEEK_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
JSON_FENCE, FENCE_END = "```json", "```"


HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{schemas}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""System-prompt section of the Hermes tool format, for templates that render no tools themselves."""
PROBE_TOOL = "flowstate_probe_tool"


class TemplateRenderError(ValueError):
    """The model's chat template failed on these messages; the message carries the template's error."""


class HFToolCallParseError(ValueError):
    """Generated text whose tool-call syntax is malformed; `text` is the raw generation."""

    def __init__(self, message: str, *, text: str) -> None:
        super().__init__(message)
        self.text = text


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def sandboxed_template(source: str):
    """The compiled template in an immutable sandbox with transformers' globals and filters."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(source)


def tool_style_of(template: str, special_tokens: Sequence[str] = ()) -> ToolStyle:
    """The tool-call syntax a template writes (Hermes/Qwen blocks, Mistral's marker, DeepSeek's tool-call
    tokens) or, when the template shows none, the one whose marker is a special token of the tokenizer."""
    for marker, style in ((HERMES_START, "hermes"), (MISTRAL_START, "mistral"), (DEEPSEEK_START, "deepseek")):
        if marker in template:
            return style
    for marker, style in ((DEEPSEEK_START, "deepseek"), (MISTRAL_START, "mistral"), (HERMES_START, "hermes")):
        if marker in special_tokens:
            return style
    return "none"


def _added_tokens(directory: Path) -> list[str]:
    """The special tokens tokenizer.json adds to its vocabulary ([] when it lists none or is unreadable here;
    the tokenizer loader reports a broken file)."""
    try:
        added = json.loads((directory / TOKENIZER_FILE).read_text()).get("added_tokens")
    except (OSError, ValueError, AttributeError):
        return []
    return [str(token.get("content")) for token in added if isinstance(token, dict)] if isinstance(added, list) else []


def _template_messages(messages: Sequence[dict[str, Any]], *, arguments_as_text: bool) -> list[dict[str, Any]]:
    """OpenAI messages as templates expect them: tool-call arguments as objects (templates that `tojson`
    them), or as JSON text for templates that concatenate them (DeepSeek's)."""
    converted = copy.deepcopy(list(messages))
    for message in converted:
        for call in message.get("tool_calls") or ():
            function = call.get("function", {})
            arguments = function.get("arguments")
            if arguments_as_text and not isinstance(arguments, str) and arguments is not None:
                function["arguments"] = json.dumps(arguments, ensure_ascii=False)
            elif not arguments_as_text and isinstance(arguments, str):
                with contextlib.suppress(ValueError):  # left as text: the template shows what the caller sent
                    function["arguments"] = json.loads(arguments)
    return converted


def hermes_tool_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` in the Hermes tool format as plain role/content turns: the tool schemas appended to the
    system prompt (a system turn added when there is none), calls as `<tool_call>` blocks in the assistant's
    content, consecutive tool results as one user turn of `<tool_response>` blocks."""
    converted: list[dict[str, Any]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_hermes_block(call) for call in message["tool_calls"]]
            converted.append({"role": "assistant", "content": "\n".join([content, *blocks] if content else blocks)})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if converted and converted[-1].get("tool_results"):
                converted[-1]["content"] += "\n" + block
            else:
                converted.append({"role": "user", "content": block, "tool_results": True})
        else:
            converted.append({key: value for key, value in message.items() if key != "tool_calls"})
    for message in converted:
        message.pop("tool_results", None)
    if tools:
        section = HERMES_TOOLS_PROMPT.format(schemas="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if converted and converted[0].get("role") == "system":
            converted[0] = {**converted[0], "content": f"{converted[0].get('content') or ''}\n\n{section}".lstrip()}
        else:
            converted.insert(0, {"role": "system", "content": section})
    return converted


def _hermes_block(call: dict[str, Any]) -> str:
    function = call.get("function", {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{HERMES_START}\n{body}\n{HERMES_END}"


@dataclass
class HFChatFormat:
    """An imported model's template, special tokens and tool-call syntax."""

    template: str
    """Jinja source of the chat template."""

    special_tokens: dict[str, str] = field(default_factory=dict)
    """bos_token / eos_token / pad_token strings from tokenizer_config.json (passed to the template)."""

    tool_style: ToolStyle = "none"
    """Syntax the model writes tool calls in."""

    tools_in_template: bool = field(init=False, default=True)
    """Whether the template shows tools itself; when it does not, the Hermes format is used (tool_style
    becomes "hermes")."""

    def __post_init__(self) -> None:
        try:
            self._compiled = sandboxed_template(self.template)
        except TemplateError as error:
            raise TemplateRenderError(f"The chat template does not compile: {error}") from error
        # Mistral's and DeepSeek's syntaxes come with their own ways of showing tools, left to the template;
        # a template with no tool syntax of its own (or Hermes') that shows no tools gets the Hermes format.
        self.tools_in_template = self.tool_style in ("mistral", "deepseek") or self._renders_tools()
        if not self.tools_in_template:
            self.tool_style = "hermes"

    def _renders_tools(self) -> bool:
        probe = [{"type": "function", "function": {"name": PROBE_TOOL, "description": "",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        try:
            text = self._compiled.render(messages=[{"role": "user", "content": "hi"}], tools=probe,
                                         add_generation_prompt=True, **self.special_tokens)
        except (TemplateError, TypeError, ValueError):
            return False
        return PROBE_TOOL in text

    @classmethod
    def from_directory(cls, directory: str | Path) -> HFChatFormat:
        directory = Path(directory)
        template = read_chat_template(directory)
        config = json.loads((directory / TOKENIZER_CONFIG_FILE).read_text())
        special = {}
        for key in ("bos_token", "eos_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(template=template, special_tokens=special,
                   tool_style=tool_style_of(template, _added_tokens(directory)))

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of `messages` (OpenAI format) and tool schemas, by the model's template."""
        if not self.tools_in_template:
            messages, tools = hermes_tool_messages(messages, tools), None
        try:
            return self._compiled.render(
                messages=_template_messages(messages, arguments_as_text=self.tool_style == "deepseek"), tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens,
            )
        except TemplateError as error:
            raise TemplateRenderError(f"The model's chat template refused the messages: {error}") from error

    def render_assistant(self, messages: Sequence[dict[str, Any]], reply: dict[str, Any],
                         *, tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The text the template gives the assistant `reply` after `messages` (what the model must write)."""
        prompt = self.render(messages, tools=tools, add_generation_prompt=True)
        full = self.render([*messages, reply], tools=tools, add_generation_prompt=False)
        if not full.startswith(prompt):
            raise TemplateRenderError("The template renders earlier turns differently once a reply follows.")
        return full[len(prompt):]

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, OpenAI tool_calls) of a generation (the eos token, if present, is dropped)."""
        eos = self.special_tokens.get("eos_token")
        if eos:
            text = text.split(eos, 1)[0]
        return parse_tool_calls(text, self.tool_style)


def _openai_call(name: Any, arguments: Any, number: int, text: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise HFToolCallParseError(f'Tool call {number} needs a string "name".', text=text)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as error:
            raise HFToolCallParseError(f"Tool call {number} arguments are not JSON: {error}", text=text) from error
    if not isinstance(arguments, dict):
        raise HFToolCallParseError(f'Tool call {number} "arguments" must be a JSON object.', text=text)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _load_json(body: str, number: int, text: str) -> Any:
    try:
        return json.loads(body)
    except ValueError as error:
        raise HFToolCallParseError(f"Tool call {number} is not valid JSON: {error}", text=text) from error


def parse_tool_calls(text: str, style: ToolStyle) -> tuple[str, list[dict[str, Any]]]:
    """Split generated text into (content, tool_calls) by the family's tool-call syntax."""
    if style == "hermes" and HERMES_START in text:
        content, _, rest = text.partition(HERMES_START)
        calls = []
        for number, block in enumerate(rest.split(HERMES_START), start=1):
            body, closed, trailing = block.partition(HERMES_END)
            if not closed:
                raise HFToolCallParseError(f"Tool call {number} is not closed with {HERMES_END}.", text=text)
            if trailing.strip():
                raise HFToolCallParseError("Text between or after tool calls; calls must end the turn.", text=text)
            call = _load_json(body, number, text)
            if not isinstance(call, dict):
                raise HFToolCallParseError(f"Tool call {number} must be a JSON object.", text=text)
            calls.append(_openai_call(call.get("name"), call.get("arguments", {}), number, text))
        return content.rstrip(), calls
    if style == "mistral" and MISTRAL_START in text:
        content, _, body = text.partition(MISTRAL_START)
        payload = _load_json(body.strip(), 1, text)
        payload = payload if isinstance(payload, list) else [payload]
        calls = [
            _openai_call(item.get("name") if isinstance(item, dict) else None,
                         item.get("arguments", {}) if isinstance(item, dict) else None, number, text)
            for number, item in enumerate(payload, start=1)
        ]
        if not calls:
            raise HFToolCallParseError("[TOOL_CALLS] holds no calls.", text=text)
        return content.rstrip(), calls
    if style == "deepseek" and DEEPSEEK_START in text:
        return _parse_deepseek(text)
    return text, []


def _parse_deepseek(text: str) -> tuple[str, list[dict[str, Any]]]:
    """DeepSeek-V3's tool-call tokens: each call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}
    \n```<｜tool▁call▁end｜>`, all of them between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`."""
    content, _, rest = text.partition(DEEPSEEK_START)
    body, closed, trailing = rest.partition(DEEPSEEK_END)
    if not closed:
        raise HFToolCallParseError(f"The tool calls are not closed with {DEEPSEEK_END}.", text=text)
    blocks = body.split(DEEPSEEK_CALL_START)
    if trailing.strip() or blocks[0].strip():
        raise HFToolCallParseError("Text between or after tool calls; calls must end the turn.", text=text)
    calls = []
    for number, block in enumerate(blocks[1:], start=1):
        inner, call_closed, between = block.partition(DEEPSEEK_CALL_END)
        if not call_closed:
            raise HFToolCallParseError(f"Tool call {number} is not closed with {DEEPSEEK_CALL_END}.", text=text)
        if between.strip():
            raise HFToolCallParseError("Text between or after tool calls; calls must end the turn.", text=text)
        calls.append(_deepseek_call(inner, number, text))
    if not calls:
        raise HFToolCallParseError(f"{DEEPSEEK_START} holds no calls.", text=text)
    return content.rstrip(), calls


def _deepseek_call(inner: str, number: int, text: str) -> dict[str, Any]:
    """One call between the call tokens: V3's `function<｜tool▁sep｜>NAME\n```json\n{...}\n```` or V3.1's
    `NAME<｜tool▁sep｜>{...}` (no type, no fence)."""
    kind, separated, spec = inner.partition(DEEPSEEK_SEP)
    if not separated:
        raise HFToolCallParseError(f"Tool call {number} lacks {DEEPSEEK_SEP} between its name and arguments.",
                                   text=text)
    if kind.strip() != "function" or spec.lstrip().startswith("{"):  # V3.1: the name, then the JSON object
        return _openai_call(kind.strip(), _load_json(spec, number, text), number, text)
    name, _, arguments = spec.partition("\n")
    arguments = arguments.strip()
    if not (arguments.startswith(JSON_FENCE) and arguments.endswith(FENCE_END) and len(arguments) > 10):
        raise HFToolCallParseError(f"Tool call {number} arguments must be a ```json block.", text=text)
    payload = _load_json(arguments[len(JSON_FENCE):-len(FENCE_END)], number, text)
    return _openai_call(name.strip(), payload, number, text)


class ToolCallStream:
    """Incremental parse of a streamed generation: content deltas as they come, tool calls when complete.

    Text that could be the start of a tool-call marker is held back until it is decided; once a marker
    starts, the rest of the generation is tool calls, returned by `finish` (OpenAI streams them as deltas
    with an `index`; each call is sent whole).
    """

    def __init__(self, chat: HFChatFormat) -> None:
        self.chat = chat
        self.marker = {"hermes": HERMES_START, "mistral": MISTRAL_START, "deepseek": DEEPSEEK_START}.get(
            chat.tool_style)
        self.text = ""
        self.sent = 0
        self.in_calls = False

    def feed(self, delta: str) -> str:
        """Add generated text; returns the content that is now certain (possibly empty)."""
        self.text += delta
        if self.in_calls:
            return ""
        if self.marker is None:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        start = self.text.find(self.marker, self.sent)
        if start >= 0:
            self.in_calls = True
            end = start
        else:  # hold back a possible marker start, and whitespace that would precede a marker
            end = len(self.text) - next((n for n in range(min(len(self.marker) - 1, len(self.text)), 0, -1)
                                         if self.marker.startswith(self.text[-n:])), 0)
        end = max(len(self.text[:end].rstrip()), self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content not yet returned, tool calls) at the end of the generation."""
        content, calls = self.chat.parse(self.text)
        return ("" if calls else content[self.sent:]), calls


def load_tokenizer(directory: str | Path):
    """The model's fast tokenizer (tokenizers.Tokenizer) from tokenizer.json."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(directory) / TOKENIZER_FILE))
