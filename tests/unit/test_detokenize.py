"""A request's text (models.detokenize.text_decoder): through the Rust tokenizer directly where that is
all transformers' decode does, and equal to `decode(ids, skip_special_tokens=True)` either way: on a
byte-level BPE with special tokens, a WordPiece tokenizer that cleans up spaces, and a class with its
own decode."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from cascade_service.models.detokenize import text_decoder

CORPUS = [
    "def add(a, b):\n    return a + b  # sum\n",
    "Il était une fois , un café très « chaud » .",
    "for i in range(10): print(i ** 2) ; x = [1, 2, 3] ?",
    "日本語のテキストも少し 🙂 and emoji",
]
SPECIALS = ["<s>", "</s>", "<pad>"]


def _bpe(**kwargs) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS * 4,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", **kwargs)


def _wordpiece(**kwargs) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)  # so that only transformers cleans up
    tok.train_from_iterator(CORPUS * 4, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", **kwargs)


def _samples(tokenizer, n: int = 200) -> list[list[int]]:
    rng = random.Random(0)
    size = len(tokenizer)
    encoded = [tokenizer(text)["input_ids"] for text in CORPUS]
    # Random ids (specials and split multi-byte characters among them) and windows of real text.
    samples = [[rng.randrange(size) for _ in range(rng.randint(0, 12))] for _ in range(n)]
    samples += [ids[i : i + w] for ids in encoded for i in range(len(ids)) for w in (1, 3, 8)]
    return samples


def test_a_fast_tokenizer_decodes_through_rust_to_decodes_own_text():
    tokenizer = _bpe(clean_up_tokenization_spaces=False)
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in _samples(tokenizer)]
    decode = text_decoder(tokenizer)

    def wrapper(*args, **kwargs):
        raise AssertionError("decoded through transformers' decode")

    tokenizer.decode = wrapper  # the fast path never reaches it
    assert [decode(ids) for ids in _samples(tokenizer)] == expected
    assert any("\ufffd" in text for text in expected) and any(text.strip() for text in expected)


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode():
    tokenizer = _wordpiece(clean_up_tokenization_spaces=True)
    samples = _samples(tokenizer)
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in samples]
    assert [text_decoder(tokenizer)(ids) for ids in samples] == expected
    # The clean-up changes some of them, so a decoder that skipped it would fail above.
    rust = tokenizer.backend_tokenizer
    assert any(rust.decode(ids, skip_special_tokens=True) != text for ids, text in zip(samples, expected, strict=True))


def test_a_class_with_its_own_decode_keeps_it():
    class Shouting(PreTrainedTokenizerFast):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    base = _bpe(clean_up_tokenization_spaces=False)
    tokenizer = Shouting(tokenizer_object=base.backend_tokenizer, eos_token="</s>")
    ids = tokenizer("def add(a, b):")["input_ids"]
    assert text_decoder(tokenizer)(ids) == "DEF ADD(A, B):"


@pytest.mark.parametrize("make", [_bpe, _wordpiece])
def test_ids_of_any_sequence_type_decode_alike(make):
    tokenizer = make(clean_up_tokenization_spaces=False)
    ids = tokenizer(CORPUS[0])["input_ids"]
    decode = text_decoder(tokenizer)
    assert decode(tuple(ids)) == decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
