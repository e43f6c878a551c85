"""Suffix decoding's memory of finished requests belongs to one API key (invariant 8), through the
standalone gRPC server and the SDK, suffix decoding the only drafter, greedy, the K-matrix fixed.

- a key repeating its own prompt drafts from its history (its target calls drop, as in-process);
- a key that has sent nothing pays the same target calls after another key sent that prompt as the
  first caller did on a fresh server;
- under token-v3 at alpha 0.5 (a rule that keeps any draft the target finds half as likely as its
  own choice) no 8-gram of one key's distinctive text reaches another key's output, while the same
  scenario on a server without keys (one shared space, as documented) does leak it: the negative
  control that shows the check can fail.
"""

from __future__ import annotations

import pytest
import torch

from cascade_service.api.server import start_server
from cascade_service.client import CascadeClient
from cascade_service.config import GenerationConfig, ModelTierConfig, SuffixConfig, make_cascade
from cascade_service.inprocess import InProcess
from cascade_service.rpc.auth import load_api_keys
from cascade_service.sessions import MemoryStore
from cascade_service.zoo.tiny import random_prompts

from ..helpers.access import KEY_A, KEY_B
from ..helpers.oracle import oracle

PROMPT = random_prompts(1, 24, seed=61)[0]
NEW = 48
TOKEN_V3 = {"verification": "token-v3", "alpha": 0.5}


@pytest.fixture(scope="module")
def engine(tiny_family):
    cascade = make_cascade(ModelTierConfig("target", str(tiny_family["target"])), [SuffixConfig()], [[16]], 1.0)
    return InProcess(cascade)


def serve(engine: InProcess, keys_file=None):
    """A fresh server (its own suffix caches) over the engine's models: (server, address)."""
    coordinator = engine.coordinator(MemoryStore(), GenerationConfig(max_new_tokens=NEW, speculation="fixed"))
    server, port = start_server(coordinator, api_keys=load_api_keys(keys_file) if keys_file else None)
    return server, f"127.0.0.1:{port}"


def calls(address: str, key: str | None, prompt: list[int], **extra) -> tuple[list[int], int]:
    with CascadeClient(address, timeout_s=120, api_key=key) as client:
        reply = client.generate(prompt_token_ids=prompt, max_new_tokens=NEW, **extra)
    return list(reply.token_ids), int(reply.stats["target_calls"])


def test_a_key_drafts_from_its_own_history_and_never_from_another_keys(engine, keys_file, tiny_family):
    server, address = serve(engine, keys_file)
    try:
        expected = oracle(tiny_family["target"], PROMPT, NEW)
        tokens, fresh = calls(address, KEY_A, PROMPT)
        assert tokens == expected
        tokens, other = calls(address, KEY_B, PROMPT)  # B has sent nothing: A's request must not help
        assert tokens == expected and other == fresh
        tokens, again = calls(address, KEY_A, PROMPT)  # A again: its own history drafts
        assert tokens == expected and again < fresh / 2
        tokens, own = calls(address, KEY_B, PROMPT)
        assert tokens == expected and own < fresh / 2
        print(f"target calls for {NEW} tokens: A fresh {fresh}, B after A {other}, A again {again}, B again {own}")
    finally:
        server.stop(0)


def runner_up_text(model_dir, prefix: list[int], n: int) -> list[int]:
    """Text the target finds plausible but would not write greedily: at each step its second choice
    where token-v3 at alpha 0.5 keeps it (p >= max p / 2), else its first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    sequence = list(prefix)
    for _ in range(n):
        with torch.no_grad():
            probs = model(torch.tensor([sequence])).logits[0, -1].softmax(-1)
        top = probs.topk(2)
        sequence.append(int(top.indices[1] if top.values[1] >= 0.5 * top.values[0] else top.indices[0]))
    return sequence[len(prefix) :]


def grams(tokens: list[int], n: int = 8) -> set[tuple[int, ...]]:
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


@pytest.mark.parametrize("keys", [True, False], ids=["keys", "no-keys-control"])
def test_no_8_gram_of_one_keys_text_reaches_another_keys_output(engine, keys_file, tiny_family, keys):
    prefix = random_prompts(1, 16, seed=62)[0]
    secret = runner_up_text(tiny_family["target"], prefix, 40)
    distinctive = grams(secret) - grams(oracle(tiny_family["target"], prefix, NEW))
    assert len(distinctive) >= 20  # the secret is not what the target writes on its own
    server, address = serve(engine, keys_file if keys else None)
    try:
        calls(address, KEY_A if keys else None, prefix + secret)  # A's text joins A's trie
        leaked, _ = calls(address, KEY_B if keys else None, prefix, **TOKEN_V3)
    finally:
        server.stop(0)
    found = grams(leaked) & distinctive
    print(f"keys={keys}: {len(found)} of {len(distinctive)} distinctive 8-grams of A in B's output")
    if keys:
        assert not found
    else:  # one shared space: B's lossy output copies A's text (why keys partition the trie)
        assert len(found) >= 5
