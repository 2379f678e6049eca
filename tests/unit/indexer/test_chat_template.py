import json
import sys
from array import array
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from indexer import chat_template
from indexer.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplateError,
    compile_chat_template,
    normalize_messages,
    render_and_encode,
    render_chat,
)
from indexer.tokenizer import ByteTokenizer, load_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "2+2?"},
]

# A Llama-like template: BOS first, a leading system message dropped, alternation enforced.
LLAMA_LIKE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set turns = messages[1:] %}{% else %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% else %} {{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def hf_dir(tmp_path: Path, config: dict) -> Path:
    words = ["[UNK]", "<s>", "</s>", "[INST]", "[/INST]", "hello", "world", "good", "bye"]
    backend = BackendTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def byte_ids(*pieces) -> array:
    """Ids of pieces: str pieces as UTF-8 bytes, int pieces as themselves (special ids)."""
    ids = array("I")
    for piece in pieces:
        ids.extend([piece] if isinstance(piece, int) else piece.encode())
    return ids


# The default (ChatML) template


def test_default_template_exact_string():
    assert render_chat(CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_default_template_exact_ids_with_the_byte_tokenizer():
    start, end = ByteTokenizer.IM_START_ID, ByteTokenizer.IM_END_ID
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🙂"}]
    assert render_and_encode(ByteTokenizer(), messages) == byte_ids(
        start, "system\nBe brief.", end, "\n", start, "user\nhéllo 🙂", end, "\n", start, "assistant\n"
    )
    assert render_and_encode(ByteTokenizer(), messages)[:3] == array("I", [258, 115, 121])


def test_default_template_without_generation_prompt():
    assert render_chat([{"role": "user", "content": "x"}], add_generation_prompt=False) == "<|im_start|>user\nx<|im_end|>\n"


@pytest.mark.parametrize(
    "messages",
    [
        CONVERSATION,
        [{"role": "user", "content": ""}],
        [{"role": "tool", "content": "{\"ok\": true}", "tool_call_id": "c1"}, {"role": "user", "content": "a\n\nb "}],
    ],
)
def test_python_default_matches_its_jinja_source(messages):
    assert render_chat(messages) == render_chat(messages, DEFAULT_CHAT_TEMPLATE)
    assert render_chat(messages, add_generation_prompt=False) == render_chat(
        messages, DEFAULT_CHAT_TEMPLATE, add_generation_prompt=False
    )


def test_text_parts_are_joined_with_newlines_and_null_assistant_content_is_empty():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
    ]
    assert render_chat(messages) == (
        "<|im_start|>user\none\ntwo<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n"
    )


def test_normalize_copies_and_keeps_extra_keys():
    message = {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c1"}
    assert normalize_messages([message]) == [{"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert message["content"] == [{"type": "text", "text": "42"}]


# Bad messages


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages must be a non-empty list"),
        ("hi", "messages must be a non-empty list"),
        (None, "messages must be a non-empty list"),
        (["hi"], r"messages\[0\] must be an object, not str"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\].role must be one of .* not 'robot'"),
        ([{"content": "x"}], r"messages\[0\].role must be one of .* not None"),
        ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\].content must be a string or a list"),
        ([{"role": "user", "content": None}], r"messages\[0\].content must be a string or a list"),
        ([{"role": "system", "content": 5}], r"messages\[0\].content must be a string or a list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            r"messages\[0\].content\[0\] must be a part of type 'text'",
        ),
        ([{"role": "user", "content": ["text"]}], r"messages\[0\].content\[0\] must be a part of type 'text'"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"messages\[0\].content\[0\].text must be a string"),
    ],
)
def test_bad_messages_raise_typed_errors(messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        render_chat(messages)
    with pytest.raises(ChatTemplateError, match=message):
        render_chat(messages, DEFAULT_CHAT_TEMPLATE)


# The tokenizer's own Jinja template


def test_jinja_template_from_tokenizer_config(tmp_path):
    config = {"chat_template": LLAMA_LIKE, "bos_token": "<s>", "eos_token": "</s>"}
    tokenizer = load_tokenizer(str(hf_dir(tmp_path, config)))
    messages = [
        {"role": "system", "content": "ignored"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": "good bye"},
    ]
    prompt = render_chat(messages, tokenizer.chat_template, bos_token="<s>", eos_token="</s>")
    assert prompt == "<s>[INST] hello [/INST] world</s>[INST] good bye [/INST]"
    # <s> [INST] hello [/INST] world </s> [INST] good bye [/INST]; no second BOS on encode.
    assert render_and_encode(tokenizer, messages) == array("I", [1, 3, 5, 4, 6, 2, 3, 7, 8, 4])


def test_raise_exception_in_a_template_is_a_typed_error(tmp_path):
    tokenizer = load_tokenizer(str(hf_dir(tmp_path, {"chat_template": LLAMA_LIKE})))
    messages = [{"role": "assistant", "content": "hello"}]
    with pytest.raises(ChatTemplateError, match="rejected the messages: roles must alternate user/assistant"):
        render_and_encode(tokenizer, messages)


def test_missing_bos_and_eos_render_as_empty_strings():
    assert render_chat([{"role": "user", "content": "x"}], "[{{ bos_token }}|{{ eos_token }}]") == "[|]"


def test_hf_tokenizer_without_template_uses_the_default(tmp_path):
    tokenizer = load_tokenizer(str(hf_dir(tmp_path, {})))
    assert tokenizer.chat_template is None
    # ChatML markers are not in this vocabulary: the whole prompt is one unknown word per piece.
    assert render_and_encode(tokenizer, [{"role": "user", "content": "hello"}]) == array("I", [0, 0, 0])


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for m in messages %}", "does not compile"),
        ("{{ messages.append(1) }}", "chat template failed: SecurityError"),
        ("{{ messages[0].__class__.__init__.__globals__ }}", "chat template failed: SecurityError"),
        ("{{ 1 // 0 }}", "chat template failed: ZeroDivisionError"),
        ("{{ messages[0]['content'].nope() }}", "chat template failed: UndefinedError"),
    ],
)
def test_template_failures_are_typed_errors(template, message):
    with pytest.raises(ChatTemplateError, match=message):
        render_chat([{"role": "user", "content": "x"}], template)


def test_template_environment_matches_hugging_face_conventions():
    messages = [{"role": "user", "content": "<a & 'b'> é", "name": "ann"}, {"role": "user", "content": "2"}]
    tojson = "{{ messages[0]['content'] | tojson }}|{{ {'b': 1, 'a': [2]} | tojson(indent=1, sort_keys=True) }}"
    assert render_chat(messages, tojson) == "\"<a & 'b'> é\"|{\n \"a\": [\n  2\n ],\n \"b\": 1\n}"
    # trim_blocks + lstrip_blocks: block tags take their own line without leaving blank lines.
    blocks = "{% for m in messages %}\n    {% if m.name %}\n{{ m.name }}: {% endif %}\n{{ m.content }}\n{% endfor %}\n"
    assert render_chat(messages, blocks) == "ann: <a & 'b'> é\n2\n"
    loop_break = "{% for m in messages %}{{ m.content }}{% break %}{% endfor %}"
    assert render_chat(messages, loop_break) == "<a & 'b'> é"
    assert render_chat(messages, "{{ strftime_now('%Y') | length }}") == "4"


def test_compiled_templates_are_cached():
    assert compile_chat_template(LLAMA_LIKE) is compile_chat_template(LLAMA_LIKE)


def test_missing_jinja2_package_names_it(monkeypatch):
    chat_template._environment.cache_clear()
    compile_chat_template.cache_clear()
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    try:
        with pytest.raises(ChatTemplateError, match="pip install jinja2"):
            render_chat([{"role": "user", "content": "x"}], "{{ 1 }}")
    finally:
        chat_template._environment.cache_clear()
    # The default template needs no jinja2 at all.
    assert render_chat([{"role": "user", "content": "x"}]).startswith("<|im_start|>user")
