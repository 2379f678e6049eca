import json
import os
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from indexer.hashing import hash_prompt, token_array
from indexer.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TokenizerError,
    check_token_ids,
    load_tokenizer,
    prompt_ids,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
WORDS = ["[UNK]", "<s>", "</s>", "hello", "world", "user", "assistant", "!", "<|im_start|>", "<|im_end|>"]


def word_level_dir(tmp_path: Path, config: dict | None = None) -> Path:
    """A WordLevel tokenizer.json (ids = positions in WORDS) and optional tokenizer_config.json."""
    backend = BackendTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def bpe_file(tmp_path: Path) -> Path:
    """A byte-level BPE trained on a few sentences, saved as tokenizer.json."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello router", "tokens and blocks"] * 20
    backend.train_from_iterator(corpus, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))
    return path


def u32(ids) -> array:
    return array("I", ids)


# ByteTokenizer: exact ids


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("", []),
        ("Hi!", [72, 105, 33]),
        ("a\nb\t", [97, 10, 98, 9]),
        ("é", [0xC3, 0xA9]),
        ("€1", [0xE2, 0x82, 0xAC, 49]),
        ("😀", [0xF0, 0x9F, 0x98, 0x80]),
        ("\x00\x7f", [0, 127]),
    ],
)
def test_byte_encode_is_utf8_bytes(text, ids):
    assert ByteTokenizer().encode(text) == u32(ids)


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("<|bos|>", [256]),
        ("<|eos|>", [257]),
        ("<|im_start|>user\nhi<|im_end|>", [258, 117, 115, 101, 114, 10, 104, 105, 259]),
        ("<|im_end|><|im_start|>", [259, 258]),
        ("x<|bos|><|bos|>y", [120, 256, 256, 121]),
        ("é<|eos|>😀", [0xC3, 0xA9, 257, 0xF0, 0x9F, 0x98, 0x80]),
        # Only exact special strings count: a truncated or differently cased one is bytes.
        ("<|im_start", [60, 124, 105, 109, 95, 115, 116, 97, 114, 116]),
        ("<|EOS|>", [60, 124, 69, 79, 83, 124, 62]),
        ("<<|eos|>|>", [60, 257, 124, 62]),
    ],
)
def test_byte_encode_special_tokens(text, ids):
    assert ByteTokenizer().encode(text) == u32(ids)


def test_byte_vocabulary_constants():
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id) == (260, 256, 257)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.chat_template) == ("<|bos|>", "<|eos|>", None)
    assert ByteTokenizer.SPECIAL_TOKENS == {"<|bos|>": 256, "<|eos|>": 257, "<|im_start|>": 258, "<|im_end|>": 259}
    assert tokenizer.name == "byte"


def test_byte_encode_add_special_tokens_prepends_bos():
    assert ByteTokenizer().encode("ab", add_special_tokens=True) == u32([256, 97, 98])
    assert ByteTokenizer().encode("", add_special_tokens=True) == u32([256])


def test_encode_returns_the_array_the_hasher_reads_without_copying():
    ids = ByteTokenizer().encode("abcd" * 8)
    assert token_array(ids) is ids
    assert hash_prompt(ids, 16, "m") == hash_prompt(list(b"abcd" * 8), 16, "m")


def test_byte_encode_matches_a_plain_reference_on_mixed_text():
    pieces = ["plain ascii ", "naïve café ", "日本語 ", "🙂🚀 ", "<|im_start|>", "<|im_end|>", "<|bos|>", "\n"]
    text = "".join(pieces[(i * 7) % len(pieces)] for i in range(3000))
    expected: list[int] = []
    for i in range(3000):
        piece = pieces[(i * 7) % len(pieces)]
        expected.extend([ByteTokenizer.SPECIAL_TOKENS[piece]] if piece in ByteTokenizer.SPECIAL_TOKENS else piece.encode())
    assert ByteTokenizer().encode(text) == u32(expected)


def test_byte_encode_of_long_text_is_exact_across_internal_slices():
    # 70 KB without special tokens: multi-byte characters straddle every slice boundary.
    text = "é😀x" * 10_000
    assert ByteTokenizer().encode(text) == u32(list(text.encode()))
    assert ByteTokenizer().encode(text + "<|eos|>" + text) == u32([*text.encode(), 257, *text.encode()])


def test_byte_encode_rejects_lone_surrogates_and_non_strings():
    with pytest.raises(TokenizerError, match="not valid Unicode"):
        ByteTokenizer().encode("ok\ud800")
    with pytest.raises(TokenizerError, match="must be a string, not bytes"):
        ByteTokenizer().encode(b"ok")


# ByteTokenizer: decode


@pytest.mark.parametrize("text", ["", "Hi!", "naïve café 日本語 🙂🚀", "<|im_start|>user\n😀<|im_end|>\n", "a<|bos|><|eos|>b"])
def test_byte_decode_round_trips_with_special_tokens_kept(text):
    tokenizer = ByteTokenizer()
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_byte_decode_skips_special_tokens_by_default():
    tokenizer = ByteTokenizer()
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user\nhé<|im_end|>")) == "user\nhé"
    assert tokenizer.decode([256, 257, 258, 259]) == ""


def test_byte_decode_accepts_lists_and_replaces_invalid_utf8():
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([104, 0xFF, 105]) == "h\ufffdi"
    assert tokenizer.decode([0xF0, 0x9F]) == "\ufffd"
    # Bytes on either side of a special token never join into one character.
    assert tokenizer.decode([0xC3, 258, 0xA9]) == "\ufffd\ufffd"
    assert tokenizer.decode([0xC3, 258, 0xA9], skip_special_tokens=False) == "\ufffd<|im_start|>\ufffd"


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([260], "token id 260 is out of range"),
        ([97, 258, 1000], "token id 1000 is out of range"),
        ([0xD800], r"must be in \[0, 260\)"),
        ([2**31], r"must be in \[0, 260\)"),
        ([-1], "must be integers"),
        ([1.5], "must be integers"),
        (["a"], "must be integers"),
    ],
)
def test_byte_decode_rejects_bad_ids(ids, message):
    with pytest.raises(TokenizerError, match=message):
        ByteTokenizer().decode(ids)


def test_check_token_ids():
    ids = u32([0, 9])
    assert check_token_ids(ids, 10) is ids
    assert check_token_ids([3, 4], 10) == u32([3, 4])
    assert check_token_ids([], 10) == u32([])
    with pytest.raises(TokenizerError, match=r"token id 10 is out of range \[0, 10\)"):
        check_token_ids([1, 10], 10)


# HFTokenizer


def test_hf_word_level_exact_ids_and_config(tmp_path):
    directory = word_level_dir(tmp_path, {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}})
    tokenizer = HFTokenizer.from_file(directory / "tokenizer.json")
    assert tokenizer.encode("hello world !") == u32([3, 4, 7])
    assert tokenizer.encode("hello there") == u32([3, 0])
    assert tokenizer.encode("<|im_start|>user hello<|im_end|>") == u32([8, 5, 3, 9])
    assert tokenizer.encode("hello", add_special_tokens=True) == u32([1, 3])
    assert (tokenizer.bos_token, tokenizer.bos_token_id, tokenizer.eos_token, tokenizer.eos_token_id) == ("<s>", 1, "</s>", 2)
    assert (tokenizer.vocab_size, tokenizer.chat_template, tokenizer.name) == (10, None, str(directory / "tokenizer.json"))
    assert tokenizer.decode([1, 3, 4, 2]) == "hello world"
    assert tokenizer.decode(u32([1, 3, 4, 2]), skip_special_tokens=False) == "<s> hello world </s>"


def test_hf_without_config_has_no_bos_or_eos(tmp_path):
    tokenizer = HFTokenizer.from_file(word_level_dir(tmp_path) / "tokenizer.json")
    assert (tokenizer.bos_token, tokenizer.bos_token_id, tokenizer.eos_token, tokenizer.eos_token_id) == (None, None, None, None)


def test_hf_never_truncates_or_pads_even_when_the_file_says_so(tmp_path):
    backend = BackendTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.enable_truncation(max_length=2)
    backend.enable_padding(length=8, pad_id=0)
    backend.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path)).encode("hello world hello") == u32([3, 4, 3])


def test_hf_trained_bpe_round_trip(tmp_path):
    tokenizer = load_tokenizer(str(bpe_file(tmp_path)))
    assert isinstance(tokenizer, HFTokenizer)
    for text in ["the quick brown fox", "hello router", "unseen wörds ✓ 🙂", "  spaces\n\nand lines "]:
        ids = tokenizer.encode(text)
        assert ids.typecode == token_array(()).typecode
        assert tokenizer.decode(ids) == text
    ids = tokenizer.encode("<|im_start|>hello<|im_end|>")
    assert (ids[0], ids[-1]) == (1, 2)
    assert tokenizer.decode(ids) == "hello"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"


def test_hf_decode_and_encode_reject_bad_input(tmp_path):
    tokenizer = HFTokenizer.from_file(word_level_dir(tmp_path) / "tokenizer.json")
    with pytest.raises(TokenizerError, match=r"token id 10 is out of range \[0, 10\)"):
        tokenizer.decode([3, 10])
    with pytest.raises(TokenizerError, match="lone surrogate"):
        tokenizer.encode("hello \udc80")
    with pytest.raises(TokenizerError, match="must be a string, not int"):
        tokenizer.encode(5)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"chat_template": "{{ bos_token }}"}, "{{ bos_token }}"),
        ({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}, "D"),
        ({}, None),
    ],
)
def test_hf_chat_template_from_config(tmp_path, config, expected):
    assert HFTokenizer.from_file(word_level_dir(tmp_path, config) / "tokenizer.json").chat_template == expected


def test_hf_chat_template_jinja_file_wins_over_config(tmp_path):
    directory = word_level_dir(tmp_path, {"chat_template": "from config"})
    (directory / "chat_template.jinja").write_text("from file\n")
    assert load_tokenizer(str(directory)).chat_template == "from file\n"


@pytest.mark.parametrize(
    ("config_text", "message"),
    [
        ("{not json", "cannot read"),
        ("[1, 2]", "must hold a JSON object"),
        (json.dumps({"eos_token": "<eot>"}), "eos_token '<eot>' .* is not in its vocabulary"),
        (json.dumps({"bos_token": 5}), "bos_token in tokenizer_config.json must be a string"),
        (json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}), r"no 'default' template \(has \['tool_use'\]\)"),
        (json.dumps({"chat_template": 3}), "chat_template must be a string or a list, not int"),
    ],
)
def test_hf_bad_tokenizer_config(tmp_path, config_text, message):
    directory = word_level_dir(tmp_path)
    (directory / "tokenizer_config.json").write_text(config_text)
    with pytest.raises(TokenizerError, match=message):
        HFTokenizer.from_file(directory / "tokenizer.json")


def test_hf_bad_tokenizer_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": 42}')
    with pytest.raises(TokenizerError, match=f"cannot load tokenizer {path}"):
        HFTokenizer.from_file(path)


def test_missing_tokenizers_package_names_it(tmp_path, monkeypatch):
    path = word_level_dir(tmp_path) / "tokenizer.json"
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(TokenizerError, match="pip install tokenizers"):
        HFTokenizer.from_file(path)


# load_tokenizer


def test_load_tokenizer_specs(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    directory = word_level_dir(tmp_path)
    from_dir, from_file = load_tokenizer(str(directory)), load_tokenizer(directory / "tokenizer.json")
    assert from_dir.encode("hello") == from_file.encode("hello") == u32([3])


@pytest.mark.parametrize("spec", ["no/such/dir", "missing.json"])
def test_load_tokenizer_missing_paths(tmp_path, spec):
    with pytest.raises(TokenizerError, match="no such tokenizer.json"):
        load_tokenizer(str(tmp_path / spec))


def test_load_tokenizer_directory_without_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="no such tokenizer.json"):
        load_tokenizer(str(tmp_path))


# prompt_ids


def test_prompt_ids_for_strings_add_the_bos():
    assert prompt_ids(ByteTokenizer(), "hi") == u32([256, 104, 105])


def test_prompt_ids_for_token_lists_and_arrays():
    ids = u32([1, 259])
    assert prompt_ids(ByteTokenizer(), ids) is ids
    assert prompt_ids(ByteTokenizer(), [0, 104, 259]) == u32([0, 104, 259])


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "prompt is empty"),
        (u32([]), "prompt is empty"),
        ([1, 260], r"token id 260 is out of range \[0, 260\)"),
        ([1, -1], "must be integers"),
        ([1, True], "must be integers"),
        ([1, 2.0], "must be integers"),
        (["a", "b"], "batched prompts are not supported"),
        ([[1, 2], [3]], "batched prompts are not supported"),
        ({"text": "x"}, "must be a string or a list of token ids, not dict"),
        (None, "must be a string or a list of token ids, not NoneType"),
    ],
)
def test_prompt_ids_rejects(prompt, message):
    with pytest.raises(TokenizerError, match=message):
        prompt_ids(ByteTokenizer(), prompt)


def test_prompt_ids_with_hf_tokenizer(tmp_path):
    tokenizer = load_tokenizer(str(word_level_dir(tmp_path)))
    assert prompt_ids(tokenizer, "hello world") == u32([1, 3, 4])
    with pytest.raises(TokenizerError, match=r"out of range \[0, 10\)"):
        prompt_ids(tokenizer, [3, 11])


# Determinism across processes

_SUBPROCESS = """
import json, sys
from indexer.tokenizer import load_tokenizer
texts = json.loads(sys.argv[2])
print(json.dumps([load_tokenizer(spec).encode(t).tolist() for spec in (None, sys.argv[1]) for t in texts]))
"""


def test_same_ids_in_a_fresh_process_with_another_hash_seed(tmp_path):
    spec = str(bpe_file(tmp_path))
    texts = ["hello world", "the lazy dog 🙂", "<|im_start|>user\nhé<|im_end|>\n"]
    here = [load_tokenizer(s).encode(t).tolist() for s in (None, spec) for t in texts]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS, spec, json.dumps(texts)],
        capture_output=True, text=True, check=True, cwd=REPO_ROOT, env=env,
    )
    assert json.loads(out.stdout) == here


def test_unreadable_chat_template_jinja_file(tmp_path):
    directory = word_level_dir(tmp_path)
    (directory / "chat_template.jinja").write_bytes(b"\xff\xfe bad")
    with pytest.raises(TokenizerError, match="cannot read .*chat_template.jinja"):
        load_tokenizer(str(directory))
