"""worker.text: incremental detokenization, held-back text and stop strings, exact deltas."""

from __future__ import annotations

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from indexer.tokenizer import ByteTokenizer, HFTokenizer
from worker.text import TextStream

TOK = ByteTokenizer()
EOS = ByteTokenizer.EOS_ID


def ids(text: str) -> list[int]:
    return list(TOK.encode(text))


def feed(stream: TextStream, text: str) -> list[str]:
    """Feeds `text` one byte token at a time; the deltas returned."""
    return [stream.add([token]) for token in ids(text)]


def test_text_streams_token_by_token_without_stops():
    stream = TextStream(TOK)
    assert feed(stream, "ab c") == ["a", "b", " ", "c"]
    assert stream.flush() == "" and stream.num_tokens == 4 and not stream.stopped


def test_text_before_a_stop_string_is_held_back_then_released():
    stream = TextStream(TOK, ("abc",))
    assert feed(stream, "xab") == ["x", "", ""]  # "ab" may begin "abc"
    assert stream.add(ids("d")) == "abd"  # it did not
    assert feed(stream, "ab") == ["", ""]
    assert stream.flush() == "ab" and stream.text == "xabdab"


def test_a_stop_string_ends_the_text_and_later_tokens_are_ignored():
    stream = TextStream(TOK, ("lo w", "xyz"))
    # Each "l" may begin "lo w": held until the next character shows it does not.
    assert feed(stream, "hello") == ["h", "e", "", "l", ""]
    assert stream.add(ids(" ")) == ""
    assert stream.add(ids("w")) == ""  # the stop string never shows
    assert stream.stopped and stream.text == "hel" and stream.num_tokens == 7
    assert stream.add(ids("more")) == "" and stream.num_tokens == 7 and stream.flush() == ""


def test_the_earliest_of_several_stop_strings_wins_within_one_add():
    stream = TextStream(TOK, ("c", "bc"))
    assert stream.add(ids("abcd")) == "a"  # "c" completes both: the one starting first cuts
    assert stream.stopped and stream.num_tokens == 3  # "d" was never consumed


def test_eos_decodes_to_nothing_but_counts():
    stream = TextStream(TOK)
    assert stream.add([*ids("ok"), EOS]) == "ok" and stream.num_tokens == 3


def test_multibyte_characters_wait_for_their_last_byte():
    stream = TextStream(TOK)
    assert feed(stream, "é€") == ["", "é", "", "", "€"]
    cut = TextStream(TOK)
    assert [cut.add([token]) for token in ids("a€")[:3]] == ["a", "", ""]
    assert cut.flush() == "\ufffd"  # the output ended inside a character


def test_bpe_deltas_join_to_the_full_decode(tmp_path):
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(["the quick brown fox, naïve café"] * 10, trainer=trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    token_ids = list(tokenizer.encode("the quick brown café fox, naïve"))
    stream = TextStream(tokenizer, ("fox,",))
    deltas = [stream.add([token]) for token in token_ids]
    assert "".join(deltas) + stream.flush() == "the quick brown café "
    assert stream.stopped
