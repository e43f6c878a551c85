"""A request's output (output.Output): a reply made whole has the tokens, text, finish and logprobs a
stream of the same rounds sends, whatever ends it; a stop string keeps the token that completed it and
cuts the text just before it; an end-of-sequence token is kept and ends the request."""

from __future__ import annotations

import pytest

from cascade_service.output import Output

EOS = 0
WORDS = {EOS: "", 1: "a", 2: " ", 3: ".", 4: "b", 5: "END", 6: "\ufffd"}


def detokenize(ids) -> str:
    # Not prefix-stable, as tokenizers that clean up spaces are not: " ." becomes "." once "." follows.
    return "".join(WORDS[t] for t in ids).replace(" .", ".")


def _stream(rounds, stop=(), logprobs=None):
    logprobs = list(range(sum(map(len, rounds)))) if logprobs is None else logprobs
    output = Output(detokenize, stop, frozenset({EOS}), logprobs)
    chunks = []
    for new in rounds:
        chunk = output.feed(list(new))
        if chunk is not None:
            chunks.append(chunk)
        if output.done:
            break
    return chunks + [output.end(None, 0)]


def _whole(rounds, stop=(), logprobs=None):
    logprobs = list(range(sum(map(len, rounds)))) if logprobs is None else logprobs
    output = Output(detokenize, stop, frozenset({EOS}), logprobs)
    for new in rounds:
        output.add(list(new))
        if output.done:
            break
    return output.whole(None, 0)


CASES = {
    "length": ([[1, 2], [3, 4], [1]], ()),
    "stop": ([[1, 4], [5, 1, 1], [4]], ("END",)),
    "stop across rounds": ([[1, 5], [4, 1], [1]], ("ENDb",)),
    "eos": ([[1, 2], [4, EOS], [1]], ()),
    "held back": ([[1, 6], [6, 4], [1]], ("ab",)),
    "cleaned up": ([[1, 2], [3], [2, 3]], ()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_whole_reply_is_what_a_stream_of_the_same_rounds_sends(case):
    rounds, stop = CASES[case]
    chunks, whole = _stream(rounds, stop), _whole(rounds, stop)
    assert whole.token_ids == [t for c in chunks for t in c.token_ids]
    assert whole.text == "".join(c.text for c in chunks)
    assert whole.logprobs == [p for c in chunks for p in c.logprobs]
    assert whole.finish_reason == chunks[-1].finish_reason
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_a_stop_string_keeps_its_last_token_and_cuts_the_text_before_it():
    whole = _whole([[1, 4], [5, 1, 1], [4]], ("END",))
    assert (whole.token_ids, whole.text, whole.finish_reason) == ([1, 4, 5], "ab", "stop")
    assert whole.logprobs == [0, 1, 2]  # those of the kept tokens only


def test_an_end_of_sequence_token_is_kept_and_ends_the_request():
    chunks = _stream([[1, 2], [4, EOS], [1]])
    assert [c.token_ids for c in chunks] == [[1, 2], [4, EOS]]  # the round that ended it goes out last
    assert chunks[-1].finish_reason == "eos"


def test_a_request_that_runs_to_its_length_ends_with_an_empty_last_chunk():
    chunks = _stream([[1, 2], [4]])
    assert chunks[-1].token_ids == [] and chunks[-1].finish_reason == "length"


def test_a_whole_reply_keeps_the_text_a_stream_sent_not_a_fresh_decode():
    # Emitted text is never taken back: where decoding is not prefix-stable the reply says what a stream
    # said, not what decoding every token at the end would say.
    whole = _whole(*CASES["cleaned up"])
    assert whole.text == "a ." and detokenize(whole.token_ids) == "a.."


def _shipped_tokenizer():
    from transformers import AutoTokenizer

    from cascade_service.zoo.shipped import family_dir

    return AutoTokenizer.from_pretrained(family_dir() / "large")


def _rounds(ids, rng):
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 7)  # a round's committed tokens: one to a drafted block and its bonus
        out.append(ids[i : i + n])
        i += n
    return out


LINES = ["def f(x):\n", "    return x * 2  # é ü 中文\n", "\tif not x:\n", "'''ok'''\n"]


@pytest.mark.parametrize("source", ["code", "random ids"])
def test_a_stream_sends_the_tokenizers_own_text_of_every_token(source):
    # The oracle is the tokenizer: one decode of every token. Random ids split multi-byte characters
    # across tokens and rounds (U+FFFD held back and decoded again); code is what users stream.
    import random

    tokenizer = _shipped_tokenizer()
    rng = random.Random(7)
    for trial in range(20):
        if source == "code":
            text = "".join(rng.choice(LINES) for _ in range(60))
            ids = tokenizer(text)["input_ids"]
        else:
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 300))]
        decode = lambda t: tokenizer.decode(list(t), skip_special_tokens=True)  # noqa: E731
        output = Output(decode, (), frozenset(), [])
        sent = "".join(c.text for c in map(output.feed, _rounds(ids, rng)) if c is not None)
        assert sent + output.end(None, 0).text == decode(ids), (source, trial)


def test_a_stream_decodes_each_token_a_bounded_number_of_times():
    # A whole decode each round was quadratic: 2,000 tokens in rounds of 1-7 read ~570,000 tokens.
    import random

    read = [0]

    def decode(ids):
        read[0] += len(ids)
        return "".join(WORDS[1 + t % 4] for t in ids)

    rng = random.Random(3)
    ids = [rng.randrange(1, 50) for _ in range(2000)]
    output = Output(decode, ("zz",), frozenset({EOS}), [])
    for new in _rounds(ids, rng):
        output.feed(new)
    output.end(None, 0)
    assert read[0] <= 12 * len(ids), read[0]


def test_a_decoder_that_drops_a_leading_space_keeps_the_new_tokens_spaces():
    # SentencePiece drops the space that opens a decode; a round decoded alone would lose its first
    # space. The window starts a few tokens back, so only the settled text's start is at stake.
    import random

    def decode(ids):
        return "".join(WORDS[t] for t in ids if t != EOS).removeprefix(" ")

    rng = random.Random(5)
    for trial in range(50):
        ids = [rng.choice([1, 2, 2, 4, 5]) for _ in range(rng.randint(1, 150))]
        output = Output(decode, (), frozenset({EOS}), [])
        sent = "".join(c.text for c in map(output.feed, _rounds(ids, rng)) if c is not None)
        assert sent + output.end(None, 0).text == decode(ids), trial
