"""Output text: a request's token ids -> the text deltas its client receives.

Owns `TextStream`: incremental detokenization and stop strings. The HTTP server
(`worker/server.py`) keeps one per request and feeds it each `EngineOutput`'s tokens;
engines deal in token ids only. Pure: no I/O, no clock.

Invariants:
- stop strings never reach the client, nor does any text after them; the token that
  completes a stop string is counted in `num_tokens` (it was generated), later ones
  are not consumed.
- text that could still begin a stop string, or an incomplete UTF-8 character, is
  held back until it cannot, or until `flush` at the end of the output.
"""

from __future__ import annotations

from indexer.tokenizer import Tokenizer


class TextStream:
    """One request's output tokens -> text deltas, cut at the first stop string.

    Decoding is incremental over a window of recent tokens, so multi-token characters
    and tokenizers that merge a token with its left context decode as a whole would.
    Text that could still become a stop string (or an incomplete UTF-8 character) is
    held back until it cannot, then released; `flush` releases it at the end.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = 0  # tokens already turned into text
        self._text = ""
        self._num_emitted = 0
        self.num_tokens = 0  # tokens consumed, the one completing a stop string included
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Consumes tokens (ignored once stopped); returns the text now safe to send."""
        for token_id in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            self._token_ids.append(token_id)
            self._decode_new()
        return self._take(final=self.stopped)

    def flush(self) -> str:
        """The held-back text, at the end of the output (an incomplete character as U+FFFD)."""
        if not self.stopped and self._read_offset < len(self._token_ids):
            old_len = len(self._text)
            window = self._token_ids[self._prefix_offset :]
            known = self._tokenizer.decode(window[: self._read_offset - self._prefix_offset])
            self._text += self._tokenizer.decode(window)[len(known) :]
            self._read_offset = len(self._token_ids)
            self._check_stop(old_len)
        return self._take(final=True)

    @property
    def text(self) -> str:
        return self._text

    def _decode_new(self) -> None:
        window = self._token_ids[self._prefix_offset :]
        known = self._tokenizer.decode(window[: self._read_offset - self._prefix_offset])
        full = self._tokenizer.decode(window)
        if full.endswith("\ufffd") or len(full) <= len(known):
            return  # an incomplete character (or nothing yet): wait for the next token
        old_len = len(self._text)
        self._text += full[len(known) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        if not self._stop:
            return
        start = max(0, old_len - max(map(len, self._stop)) + 1)
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self._text = self._text[: min(hits)]
            self.stopped = True

    def _take(self, *, final: bool) -> str:
        end = len(self._text) if final else len(self._text) - self._num_held()
        delta = self._text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return delta

    def _num_held(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        held = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self._text)), held, -1):
                if self._text.endswith(stop[:size]):
                    held = size
                    break
        return held
