"""The in-process baseline in a process of its own, for side-by-side runs with the service.

A service comparison timed in the Ray driver is unfair to the in-process side: the driver also runs
Ray's core worker threads and the gRPC edge, and on a small machine the in-process engine then loses
CPU to them (we saw plain decoding drop from ~60 to ~7 tok/s). Here the engine runs in a child process
that is idle while the service is timed, and the service is idle while the child is timed.

Protocol: one JSON object per line on stdin, `{"variant": name, "ids": [...], "max_new_tokens": n}`
(or `{"threads": true}`: torch's thread settings where the child's passes run);
one JSON object per line on stdout, `{"tokens": [...], "seconds": s, "target_calls": n,
"orchestration_s": s}` (seconds measured around `InProcess.generate` only; orchestration: the engine
loop's time outside model passes) or `{"error": message}`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

CHILD_MODULE = "cascade_service.bench.inprocess"


class InProcessWorker:
    """A child process holding an `InProcess` for a config, with named variants:
    "csd" is the config's cascade, "ar" the target alone."""

    def __init__(self, config_path: str, torch_threads: int | None = None):
        command = [sys.executable, "-m", CHILD_MODULE, config_path]
        if torch_threads:
            command.append(str(torch_threads))
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"in-process worker failed to start: {ready}")

    def generate(self, variant: str, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"variant": variant, "ids": ids, "max_new_tokens": max_new_tokens}) + "\n")
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"in-process worker: {reply['error']}")
        return reply

    def thread_settings(self) -> str:
        """torch's threads where the child's passes run (engine.core.EngineCore.thread_settings)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"threads": True}) + "\n")
        return str(self._read()["threads"])

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"in-process worker exited with status {self.process.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> InProcessWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _serve(config_path: str, torch_threads: int | None) -> int:
    import torch

    from ..config import GenerationConfig, load_config
    from ..inprocess import InProcess

    if torch_threads:
        torch.set_num_threads(torch_threads)
    config = load_config(config_path)
    cascade = InProcess(config.cascade, tier_client=config.serving.tier_client)
    cascade.serve_like(config.serving)  # the service's policies (load adaptation, the floor), not the engine's default
    variants = {"csd": cascade, "ar": cascade.variant([])}
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            if request.get("threads"):
                out.write(json.dumps({"threads": cascade.core.thread_settings()}) + "\n")
                out.flush()
                continue
            engine = variants[request["variant"]]
            gen = GenerationConfig(max_new_tokens=int(request["max_new_tokens"]))
            start = time.perf_counter()
            result = engine.generate([int(t) for t in request["ids"]], gen)
            seconds = time.perf_counter() - start
            engine_time = result.stats.engine
            reply = {
                "tokens": result.token_ids,
                "seconds": seconds,
                "target_calls": result.stats.target_calls,
                # the engine loop's own time (outside model passes): its accounting, not a difference of runs
                "orchestration_s": engine_time.orchestration_s() if engine_time is not None else 0.0,
            }
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None))
