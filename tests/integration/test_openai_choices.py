"""OpenAI's `n` and `best_of`: a request per choice, each with its own seed, unary and streamed (each
streamed choice under its index); best_of keeps the likeliest candidates."""

from __future__ import annotations

import openai
import pytest

from ..helpers.openai_server import PROMPT, N, openai_client, openai_server


@pytest.fixture(scope="module")
def choices(tiny_family, tmp_path_factory):
    with openai_server(tiny_family, tmp_path_factory.mktemp("keys")) as server:
        yield openai_client(server)


def test_n_choices_each_with_its_own_seed_and_best_of_keeps_the_likeliest(choices):
    greedy = choices.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1  # greedy: the same choice three times
    assert greedy.usage.completion_tokens == 3 * N
    sampled = choices.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=1.0, n=4, seed=7)
    assert len({c.text for c in sampled.choices}) > 1  # a seed per choice
    # A sample depends on its seed and on the drafts it met (MaG's index learns from every request), so
    # best_of is checked by its own order: the n kept come likeliest first, and without logprobs asked
    # the reply carries none.
    best = choices.completions.create(
        model="target", prompt=PROMPT, max_tokens=N, temperature=1.0, n=2, best_of=5, seed=7, logprobs=0
    )
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in best.choices]
    assert len(means) == 2 and means[0] >= means[1]
    plain = choices.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=1.0, n=1, best_of=3)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_request_has_one_choice(choices, stream):
    # Checked by the servicer's rule on both paths: streamed choices would each append to the session.
    extra = {"session_id": "one-session"}
    with pytest.raises(openai.BadRequestError) as caught:
        choices.completions.create(model="target", prompt=PROMPT, max_tokens=4, n=2, stream=stream, extra_body=extra)
    assert caught.value.body["param"] == "n"


def test_n_choices_stream_together_each_under_its_index(choices):
    greedy = choices.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=0).choices[0].text
    texts: dict[int, str] = {}
    offsets: dict[int, list[int]] = {}
    ends: dict[int, str] = {}
    used = None
    for chunk in choices.completions.create(
        model="target",
        prompt=PROMPT,
        max_tokens=N,
        temperature=0,
        n=3,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            used = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            offsets.setdefault(choice.index, []).extend(choice.logprobs.text_offset)
            if choice.finish_reason:
                ends[choice.index] = choice.finish_reason
    assert texts == {0: greedy, 1: greedy, 2: greedy}  # greedy: the same text under each index
    assert ends == {0: "length", 1: "length", 2: "length"}
    assert all(o[0] == 0 for o in offsets.values())  # each choice's text offsets run on their own
    assert used is not None and used.completion_tokens == 3 * N
    sampled: dict[int, str] = {}
    for chunk in choices.completions.create(
        model="target", prompt=PROMPT, max_tokens=N, temperature=1.0, n=4, seed=7, stream=True
    ):
        for choice in chunk.choices:
            sampled[choice.index] = sampled.get(choice.index, "") + choice.text
    assert sorted(sampled) == [0, 1, 2, 3] and len(set(sampled.values())) > 1  # a seed per choice


def test_best_of_keeps_the_candidates_with_the_highest_logprob_per_token():
    from cascade_service.api.choices import mean_logprob
    from cascade_service.proto.v1 import cascade_pb2 as pb

    def reply(*logprobs: float) -> list:
        return [pb.TokenLogprob(logprob=lp) for lp in logprobs]

    candidates = [reply(-1.0, -1.0), reply(-0.1, -0.3, -0.2), reply(-2.0), reply(-0.5)]
    assert [mean_logprob(r) for r in sorted(candidates, key=mean_logprob, reverse=True)] == pytest.approx(
        [-0.2, -0.5, -1.0, -2.0]
    )
