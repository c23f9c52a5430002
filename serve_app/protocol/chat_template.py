"""The app's ``chat_template`` setting (vLLM's ``--chat-template``), a request's messages
(``ChatMessage``) and ``chat_template_kwargs``: what reaches transformers'
``apply_chat_template``.

The setting is a file's path or the template itself; a file is read once, when the app's
config is validated (``build_app``), so its text travels with the config to every Router
replica and the file needs to exist only where the app is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

from serve_app.protocol.errors import StrictModel
from serve_app.protocol.tools import ToolCall, template_arguments

# characters only a Jinja template has (vLLM tells a path from a template by them, too)
_JINJA_CHARS = "{}\n"

# apply_chat_template's own parameters: the request sets them through its own fields, or the
# server does; a template variable of the same name would be shadowed or break the call
RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def load_chat_template(value: str) -> str:
    """The template text of ``value`` (a file's path, or a template), checked to parse as
    Jinja: ``ValueError`` naming ``chat_template`` otherwise."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template file {value!r} cannot be read: {e}") from None
    elif any(c in value for c in _JINJA_CHARS):
        text = value
    else:
        raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a valid Jinja template (line {e.lineno}: "
                         f"{e.message})") from None
    return text


def reserved_kwargs(kwargs: dict[str, Any] | None) -> list[str]:
    """The keys of a request's ``chat_template_kwargs`` that it may not set."""
    return sorted(set(kwargs or ()) & RESERVED_KWARGS)


def check_chat_options(add_generation_prompt: bool, continue_final_message: bool,
                       last_role: str, kwargs: dict[str, Any] | None) -> None:
    """A chat request's template options, as vLLM checks them: ``FieldError`` (a 400 naming
    the field) for both prompts' ends at once, for continuing a message that is not the
    assistant's, and for ``chat_template_kwargs`` that set a parameter of the call itself."""
    from serve_app.protocol.errors import FieldError

    if continue_final_message and add_generation_prompt:
        raise FieldError("continue_final_message", "cannot be true together with "
                         "add_generation_prompt (true by default); set add_generation_prompt "
                         "to false")
    if continue_final_message and last_role != "assistant":
        raise FieldError("continue_final_message", f"needs the last message to be the "
                         f"assistant's (it is the {last_role}'s)")
    reserved = reserved_kwargs(kwargs)
    if reserved:
        raise FieldError("chat_template_kwargs", f"must not set {', '.join(reserved)} (set "
                         "through the request's own fields or by the server)")


def text_parts_only(content: Any) -> Any:
    """A message's content as a list may hold only text parts (this server serves text
    models): ``ValueError`` naming the other part types, before the request model's own
    union check would report them as "not a valid string"."""
    if isinstance(content, list):
        kinds = sorted({p["type"] for p in content if isinstance(p, dict)
                        and isinstance(p.get("type"), str)} - {"text"})
        if kinds:
            raise ValueError(f"only text parts are supported (a text model), got parts of type "
                             f"{', '.join(map(repr, kinds))}")
    return content


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(text_parts_only)] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it: calls' arguments as objects (templates
        print them with ``tojson``), the tool result's call id."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": template_arguments(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)
