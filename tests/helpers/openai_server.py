"""The standalone server with the OpenAI API and an API key, on the tiny family, for the OpenAI tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from cascade_service.config import Config, GenerationConfig
from cascade_service.standalone import start_standalone
from cascade_service.zoo.tiny import random_prompts

from .access import KEY_A, write_keys
from .tier_servers import tiny_cascade

PROMPT = random_prompts(1, 10, seed=53)[0]
N = 16  # the server's max_new_tokens, and what the tests ask for


@contextmanager
def openai_server(family: dict, keys_dir: Path) -> Iterator:
    """A running standalone server (`.port` gRPC, `.http_port` HTTP) that knows KEY_A."""
    from cascade_service.rpc.auth import load_api_keys

    keys = load_api_keys(write_keys(keys_dir / "keys"))
    config = Config(tiny_cascade(family), GenerationConfig(max_new_tokens=N))
    standalone = start_standalone(config, api_keys=keys, http_port=0)
    try:
        yield standalone
    finally:
        standalone.stop()


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=KEY_A, max_retries=0)
