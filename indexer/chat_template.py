"""OpenAI chat `messages` -> one prompt string (and its token ids) via a chat template.

Owns message validation, the default ChatML template and the rendering of a
tokenizer's own Jinja template. Callers: the gateway, to tokenize chat requests
before hashing their KV blocks, and the reference worker, which must produce the
same ids for the same request.

Messages are `{"role", "content"}` dicts; role is one of `ROLES`; content is a string
or a list of `{"type": "text", "text": ...}` parts, joined with "\\n" (as vLLM does),
or null for an assistant message (one that only carries `tool_calls`). Other keys
(`name`, `tool_calls`, `tool_call_id`) are passed through untouched to Jinja templates;
the default template renders only role and content.

DEFAULT template (ChatML), with the generation prompt always added:

    <|im_start|>{role}\\n{content}<|im_end|>\\n   (one per message)
    <|im_start|>assistant\\n

A tokenizer's own template is rendered in a sandbox
(`jinja2.sandbox.ImmutableSandboxedEnvironment`) configured as Hugging Face
transformers configures it (trim_blocks, lstrip_blocks, loop controls, a `tojson`
that does not HTML-escape, `raise_exception`, `strftime_now`), with `messages`,
`add_generation_prompt`, `bos_token` and `eos_token`; so the gateway renders the same
prompt as vLLM and SGLang workers do. Templates that call `strftime_now` depend on
the date, as they do there. Compiled templates are cached by source.
"""

from __future__ import annotations

import functools
import json
from array import array
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from indexer.tokenizer import Tokenizer

ROLES = frozenset({"system", "user", "assistant", "tool"})

# The default template written in Jinja; `render_chat` implements it in plain Python
# (no jinja2 needed), and tests check the two render identically.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """Chat messages are malformed, or a chat template cannot be compiled or rendered."""


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated copies of `messages` with every content as one string."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    return [_normalize_message(i, message) for i, message in enumerate(messages)]


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"{where} must be an object, not {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ChatTemplateError(f"{where}.role must be one of {sorted(ROLES)}, not {role!r}")
    normalized = dict(message)
    normalized["content"] = _content_text(where, role, message.get("content"))
    return normalized


def _content_text(where: str, role: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise ChatTemplateError(f"{where}.content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise ChatTemplateError(f"{where}.content[{j}] must be a part of type 'text'")
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{where}.content[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def render_chat(
    messages: Any,
    template: str | None = None,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt for `messages`: the default ChatML template, or the Jinja `template`."""
    normalized = normalize_messages(messages)
    if template is None:
        return _render_default(normalized, add_generation_prompt)
    compiled = compile_chat_template(template)
    context = {
        "messages": normalized,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token or "",
        "eos_token": eos_token or "",
    }
    try:
        return compiled.render(context)
    except ChatTemplateError:
        raise
    except Exception as exc:  # a template is foreign code: any failure is a bad request, not a crash
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def _render_default(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    pieces = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        pieces.append("<|im_start|>assistant\n")
    return "".join(pieces)


def render_and_encode(tokenizer: Tokenizer, messages: Any) -> array:
    """The token ids of `messages` rendered with the tokenizer's template (or the default).

    The template writes any BOS itself, so no special tokens are added on encode.
    """
    prompt = render_chat(
        messages,
        tokenizer.chat_template,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )
    return tokenizer.encode(prompt, add_special_tokens=False)


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> Any:
    """The compiled `jinja2.Template` for `source` (cached); call at startup to validate."""
    environment = _environment()
    try:
        return environment.from_string(source)
    except Exception as exc:  # jinja2.TemplateSyntaxError and friends, imported lazily
        raise ChatTemplateError(f"chat template does not compile: {exc}") from None


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateError("rendering a Jinja chat template needs the 'jinja2' package: pip install jinja2") from None
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML, which would change prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the messages: {message}")


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)
