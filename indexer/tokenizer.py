"""Text <-> token ids: the one tokenization the gateway and the reference worker share.

Owns the `Tokenizer` protocol and its two implementations, `ByteTokenizer` (the
default, needs no files) and `HFTokenizer` (a Hugging Face `tokenizer.json`), plus
`load_tokenizer` and `prompt_ids`, which turns a completions `prompt` into token ids.

Who calls it: the gateway tokenizes every request here before hashing its KV blocks
(`indexer.hashing`); the reference worker tokenizes the same requests with the same
code, so for identical requests both get identical ids, which is what makes the
router's block hashes name the worker's cached blocks.

Invariants:
- `encode` returns an `array` of uint32 with the typecode `indexer.hashing` hashes
  without copying. It never truncates or pads, and never adds special tokens unless
  asked (`add_special_tokens=True` adds what the tokenizer's own rules add: the BOS).
- Special-token strings in the text (e.g. `<|im_start|>`) encode to their special
  ids wherever they appear. Chat templates rely on this; it also means a user who
  types one gets the special id, exactly as Hugging Face tokenizers and vLLM do.
- Output depends only on the text and the tokenizer files: never on the Python
  process, PYTHONHASHSEED or the platform.

It lives in `indexer/` beside the block hashing it feeds, so that both the router and
the worker can import it (dependencies point down only).
"""

from __future__ import annotations

import json
import re
import sys
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from indexer.hashing import token_array

TokenIds = Sequence[int] | array

# The typecode `indexer.hashing` reads without copying ('I', uint32, on every platform).
_U32 = token_array(()).typecode
# One UTF-32 code unit per uint32, in the machine's order: turns a str of code points
# <= 0x10FFFF into token-id bytes (and back) entirely in C.
_UTF32 = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"
_WIDEN_STEP = 16384


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded, or a text or token ids cannot be (de)tokenized."""


class Tokenizer(Protocol):
    """What the gateway and the worker need from a tokenizer."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int:
        """Every valid token id is in [0, vocab_size)."""

    @property
    def bos_token(self) -> str | None: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token(self) -> str | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own Jinja chat template, or None to use the default one."""

    def encode(self, text: str, *, add_special_tokens: bool = False) -> array: ...

    def decode(self, ids: TokenIds, *, skip_special_tokens: bool = True) -> str: ...


def check_token_ids(ids: TokenIds, vocab_size: int) -> array:
    """`ids` as a uint32 array, after checking every id is an int in [0, vocab_size)."""
    checked = _u32(ids)
    if checked and max(checked) >= vocab_size:
        raise TokenizerError(f"token id {max(checked)} is out of range [0, {vocab_size})")
    return checked


def _u32(ids: TokenIds) -> array:
    try:
        return token_array(ids)
    except (TypeError, ValueError):
        raise TokenizerError("token ids must be integers in [0, 2**32)") from None


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus four special tokens; the reference model's vocabulary.

    Ids 0..255 are the UTF-8 bytes of the text. Special ids:
    256 `<|bos|>`, 257 `<|eos|>`, 258 `<|im_start|>`, 259 `<|im_end|>`; vocab_size 260.
    It ships no chat template (the default ChatML one in `chat_template` matches its
    `<|im_start|>` / `<|im_end|>`). `add_special_tokens=True` prepends `<|bos|>`.
    """

    BOS_ID = 256
    EOS_ID = 257
    IM_START_ID = 258
    IM_END_ID = 259
    SPECIAL_TOKENS: dict[str, int] = {
        "<|bos|>": BOS_ID,
        "<|eos|>": EOS_ID,
        "<|im_start|>": IM_START_ID,
        "<|im_end|>": IM_END_ID,
    }
    VOCAB_SIZE = 260

    _special_re = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))
    # After decode's UTF-32 step each special id is one character U+0100..U+0103.
    _special_char_re = re.compile(f"([{chr(BOS_ID)}-{chr(VOCAB_SIZE - 1)}])")
    _special_by_char = {chr(i): s for s, i in SPECIAL_TOKENS.items()}

    name = "byte"
    vocab_size = VOCAB_SIZE
    bos_token = "<|bos|>"
    bos_token_id = BOS_ID
    eos_token = "<|eos|>"
    eos_token_id = EOS_ID
    chat_template = None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> array:
        """The UTF-8 bytes of `text` as ids, special-token strings as their special ids."""
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a string, not {type(text).__name__}")
        ids = array(_U32, [self.BOS_ID] if add_special_tokens else [])
        start = 0
        try:
            for match in self._special_re.finditer(text):
                _extend_with_bytes(ids, text[start : match.start()])
                ids.append(self.SPECIAL_TOKENS[match.group()])
                start = match.end()
            _extend_with_bytes(ids, text[start:])
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"text is not valid Unicode: {exc.reason} at {exc.start}") from None
        return ids

    def decode(self, ids: TokenIds, *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`; invalid UTF-8 becomes U+FFFD, special ids are kept or dropped."""
        # One character per id; ids above 0x10FFFF or in the surrogate range fail here.
        try:
            chars = _u32(ids).tobytes().decode(_UTF32)
        except UnicodeDecodeError:
            raise TokenizerError(f"token ids must be in [0, {self.VOCAB_SIZE})") from None
        try:
            return chars.encode("latin-1").decode("utf-8", "replace")
        except UnicodeEncodeError:
            return self._decode_with_specials(chars, skip_special_tokens)

    def _decode_with_specials(self, chars: str, skip_special_tokens: bool) -> str:
        pieces = self._special_char_re.split(chars)
        # Even indices are byte runs, odd ones single special characters.
        for i, piece in enumerate(pieces):
            if i % 2:
                pieces[i] = "" if skip_special_tokens else self._special_by_char[piece]
                continue
            try:
                pieces[i] = piece.encode("latin-1").decode("utf-8", "replace")
            except UnicodeEncodeError as exc:
                bad_id = ord(piece[exc.start])
                raise TokenizerError(f"token id {bad_id} is out of range [0, {self.VOCAB_SIZE})") from None
        return "".join(pieces)


def _extend_with_bytes(ids: array, text: str) -> None:
    """Append the UTF-8 bytes of `text` to `ids`, one uint32 per byte."""
    data = text.encode("utf-8")
    # latin-1 maps byte b to code point b, so its UTF-32 is b as a uint32. Widening in
    # slices keeps each temporary under glibc's 128 KiB mmap threshold: one whole-prompt
    # temporary made a 100 KB encode 10x slower, all of it page faults.
    for offset in range(0, len(data), _WIDEN_STEP):
        ids.frombytes(data[offset : offset + _WIDEN_STEP].decode("latin-1").encode(_UTF32))


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` behind the `Tokenizer` protocol.

    Truncation and padding stored in the tokenizer.json are switched off: a prompt is
    always tokenized whole. `vocab_size` is the highest id (added tokens included) + 1.
    """

    def __init__(
        self,
        backend: Any,
        *,
        name: str,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = False
        self._backend = backend
        self.name = name
        self.chat_template = chat_template
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.bos_token = bos_token
        self.bos_token_id = self._token_id(bos_token, "bos_token")
        self.eos_token = eos_token
        self.eos_token_id = self._token_id(eos_token, "eos_token")

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        """Load `tokenizer.json`, with `tokenizer_config.json` beside it if present."""
        path = Path(path)
        tokenizers = _import_tokenizers()
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception for bad files
            raise TokenizerError(f"cannot load tokenizer {path}: {exc}") from None
        config = _read_tokenizer_config(path.parent)
        return cls(
            backend,
            name=str(path),
            chat_template=_chat_template(path.parent, config),
            bos_token=_token_content(config.get("bos_token"), "bos_token"),
            eos_token=_token_content(config.get("eos_token"), "eos_token"),
        )

    def encode(self, text: str, *, add_special_tokens: bool = False) -> array:
        """The ids of `text`; `add_special_tokens` applies the tokenizer's post-processor."""
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a string, not {type(text).__name__}")
        try:
            encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            # The only str tokenizers refuses is one with lone surrogates.
            raise TokenizerError("text is not valid Unicode (lone surrogate)") from None
        return array(_U32, encoding.ids)

    def decode(self, ids: TokenIds, *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`, special tokens kept or dropped."""
        checked = check_token_ids(ids, self.vocab_size)
        return self._backend.decode(checked.tolist(), skip_special_tokens=skip_special_tokens)

    def _token_id(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{field} {token!r} of {self.name} is not in its vocabulary")
        return token_id


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(
            "loading a tokenizer.json needs the 'tokenizers' package: pip install tokenizers"
        ) from None
    return tokenizers


def _read_tokenizer_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return config


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """The chat template: `chat_template.jinja` if present, else the config's field."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"cannot read {jinja_file}: {exc}") from None
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    # Some configs hold a list of named templates; the unnamed request uses "default".
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise TokenizerError(f"chat_template lists no 'default' template (has {sorted(map(str, named))})")
    raise TokenizerError(f"chat_template must be a string or a list, not {type(template).__name__}")


def _token_content(value: Any, field: str) -> str | None:
    """A token from tokenizer_config.json: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{field} in tokenizer_config.json must be a string or an object with 'content'")


def load_tokenizer(spec: str | Path | None) -> Tokenizer:
    """None or "byte": `ByteTokenizer`; a tokenizer.json or a directory holding one: `HFTokenizer`."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"tokenizer {str(spec)!r}: no such tokenizer.json (use 'byte' for the byte tokenizer)")
    return HFTokenizer.from_file(path)


def prompt_ids(tokenizer: Tokenizer, prompt: Any) -> array:
    """The token ids of a completions `prompt`: a string or a list of token ids.

    A string is encoded with `add_special_tokens=True`, as OpenAI-compatible servers do
    for completions. Token ids must be ints in [0, vocab_size). Batches (lists of
    strings or of lists) are refused: one prompt per request. An empty prompt is refused.
    """
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, array):
        ids = check_token_ids(prompt, tokenizer.vocab_size)
    elif isinstance(prompt, list):
        kinds = set(map(type, prompt))
        if kinds & {str, list}:
            raise TokenizerError("batched prompts are not supported: send one prompt per request")
        if not kinds <= {int}:
            raise TokenizerError("prompt token ids must be integers")
        ids = check_token_ids(prompt, tokenizer.vocab_size)
    else:
        raise TokenizerError(f"prompt must be a string or a list of token ids, not {type(prompt).__name__}")
    if not ids:
        raise TokenizerError("prompt is empty")
    return ids
