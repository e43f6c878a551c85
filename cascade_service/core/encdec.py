"""The sequence a cascade extends for an encoder-decoder family (models.seq2seq runs the models):

    encoder input ... | decoder start | decoder tokens ...

The request's prompt, the target's decoder start token, then what the decoder produced. A prompt may
not hold the start token, so its first occurrence marks where the decoder begins, in every tier and on
every replica, with nothing carried beside the tokens. Statistical drafters see the whole sequence, so
they can copy from the input.
"""

from __future__ import annotations

from collections.abc import Sequence


def check_prompt(prompt_ids: Sequence[int], start: int) -> None:
    """An encoder-decoder request's prompt may not hold the decoder start token (it marks the split)."""
    if start in prompt_ids:
        raise ValueError(
            f"prompt: token {start} is the decoder start token of this encoder-decoder model, "
            "which an encoder input may not contain"
        )


def decoder_context(prompt_ids: Sequence[int], start: int | None) -> list[int]:
    """The sequence a cascade extends for `prompt_ids`: the prompt itself for a decoder-only target
    (`start` None), else the encoder's input and the decoder start token."""
    if start is None:
        return list(prompt_ids)
    check_prompt(prompt_ids, start)
    return [*prompt_ids, start]


def check_request(start: int | None, prompt_ids: Sequence[int], session: bool) -> None:
    """A request's fields against its target: for an encoder-decoder one (`start` not None) a prompt
    without the start token, and no session (a session continues a decoder-only model's text)."""
    if start is None:
        return
    if session:
        raise ValueError(
            "session_id: sessions continue a decoder-only model's text; an encoder-decoder model takes "
            "one input per request"
        )
    check_prompt(prompt_ids, start)
