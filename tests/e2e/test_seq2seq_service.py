"""An encoder-decoder family through the Ray Serve app: each tier its own deployment, its facts
(the decoder start token) carried by the tier API's Info, greedy output equal to `generate()`."""

from __future__ import annotations

import pytest
import torch
import yaml
from transformers import AutoModelForSeq2SeqLM

from cascade_service.client import CascadeClient, errors
from cascade_service.serving.app import APP_NAME
from cascade_service.serving.local import LocalService
from cascade_service.zoo.tiny import random_prompts


def test_the_ray_app_serves_an_encoder_decoder_cascade_exactly(tiny_family_factory, tmp_path):
    from ray import serve

    t5 = tiny_family_factory("t5")
    raw = {
        "tiers": {
            "target": {"name": "target", "path": str(t5["target"])},
            "drafters": [{"name": "close", "path": str(t5["close"])}, {"kind": "mag"}],
        },
        "schedule": {"k_matrix": [[3, 2], [0, 4]], "leniency": 1.5},
        "serving": {"torch_threads": 1},
    }
    path = tmp_path / "t5.yaml"
    path.write_text(yaml.safe_dump(raw))
    import ray

    if ray.is_initialized():  # another module's app may share this Ray: replace it (and never start
        serve.delete(APP_NAME)  # Ray here: LocalService starts it bound to loopback)
    svc = LocalService(str(path), port=0)
    svc.start()
    model = AutoModelForSeq2SeqLM.from_pretrained(t5["target"], local_files_only=True).eval()
    try:
        with CascadeClient(svc.address, timeout_s=120) as client:
            for prompt in random_prompts(2, 9, seed=61):
                with torch.inference_mode():
                    expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)[0, 1:]
                assert client.generate(prompt_token_ids=prompt, max_new_tokens=16).token_ids == expected.tolist()
            with pytest.raises(errors.InvalidArgument, match="prompt: token 0 is the decoder start token"):
                client.generate(prompt_token_ids=[4, 0, 5], max_new_tokens=4)
    finally:
        svc.stop()
