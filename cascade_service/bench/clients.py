"""The clients of `cascade-service bench load` (bench/load.py): N threads, one gRPC channel each, streaming
requests back to back, and the window a level is measured over (steady load: it opens once every client
has finished a request)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Level:
    """One concurrency level's figures. Throughput is counted two ways:

    - `tokens_per_s`: tokens that reached the clients within the level's window, per second of it.
      The clients keep exactly `concurrency` requests in flight for the whole window (closed loop), so
      this is the service's speed at that load, whatever the requests' timing.
    - `drained_tokens_per_s`: completed requests' tokens over the window plus the drain (the requests
      in flight at the deadline run to their end). It depends on where the window cuts the requests:
      servers whose requests move in lockstep (plain decoding: every stream starts and ends together)
      end a wave near the deadline and drain little; a server whose requests finish at different times
      has some just begun at the deadline, and drains them with the machine mostly idle. With requests
      half as long as the window (the real family at 8 streams: ~30 s requests, 60 s windows), in one
      block plain ran 8.4 tok/s in the window and 6.9 drained, the default 7.7 and 7.5: 0.92x in the
      window, 1.09x drained; the next block 0.90x and 0.85x. Kept for comparison with earlier tables.

    The window opens once every client has finished its first request (`ramp_s` after the start): the
    clients all arrive at once, a burst of prefills no steady load has, and a window that holds it
    measures the burst. At 64 streams on the shipped family (requests of 10-17 s) 8 s windows from the
    start held one wave and read the default at 0.61-0.94x plain at T = 1. Latencies and the drained
    figure are of the requests that began in the window.
    """

    concurrency: int
    seconds: float = 0.0  # the window plus the drain
    window_s: float = 0.0
    ramp_s: float = 0.0  # from the start until every client had finished a request: the window opened then
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0  # of completed requests
    window_tokens: int = 0  # that reached a client before the deadline, finished requests or not
    errors: dict[str, int] = field(default_factory=dict)
    rounds: int = 0  # target rounds of the completed requests (their stats' target_calls)
    drafted_rounds: int = 0  # of them, rounds whose block held a draft

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        return {
            "concurrency": self.concurrency,
            "requests": len(lat),
            "tokens": self.tokens,
            "tokens_per_s": round(self.window_tokens / self.window_s, 2) if self.window_s else 0.0,
            "drained_tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else 0.0,
            "drafted_round_share": round(self.drafted_rounds / self.rounds, 3) if self.rounds else 0.0,
            "ramp_s": round(self.ramp_s, 2),
            "p50_s": round(statistics.median(lat), 4) if lat else None,
            "p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 4) if lat else None,
            "errors": sum(self.errors.values()),
            "errors_by_code": dict(self.errors),
        }


def run_level(
    target: str,
    concurrency: int,
    duration_s: float,
    prompts: Sequence[str],
    max_new_tokens: int,
    api_key: str | None,
    timeout_s: float,
    temperature: float | None = None,
    options: dict[str, Any] | None = None,
    ramp: bool = True,
) -> Level:
    """`concurrency` clients streaming requests back to back, measured over a window of `duration_s`
    seconds that opens once each has finished a request (`ramp`; False: at the start), or after
    `timeout_s` (see Level)."""
    from ..client import CascadeClient, errors

    level = Level(concurrency, window_s=duration_s)
    lock = threading.Lock()
    sampling: dict[str, Any] = {} if temperature is None else {"temperature": temperature}  # None: server default
    sampling.update(options or {})  # the mode's own request fields (MODE_REQUESTS)
    start = time.perf_counter()
    window = _Window(start, duration_s, concurrency if ramp else 0, timeout_s)

    def worker(index: int) -> None:
        with CascadeClient(target, timeout_s=timeout_s, api_key=api_key) as client:
            i = index
            while time.perf_counter() < window.close:
                prompt = prompts[i % len(prompts)]
                i += concurrency
                began, tokens, stats = time.perf_counter(), 0, None
                try:
                    # streamed, so that each token is counted when it arrives: inside the window or not
                    for chunk in client.stream(prompt, max_new_tokens=max_new_tokens, **sampling):
                        if chunk.token_ids and window.holds(time.perf_counter()):
                            with lock:
                                level.window_tokens += len(chunk.token_ids)
                        tokens += len(chunk.token_ids)
                        stats = chunk.stats if chunk.stats is not None else stats
                except errors.CascadeError as exc:
                    with lock:
                        name = getattr(exc.code, "name", str(exc.code))
                        level.errors[name] = level.errors.get(name, 0) + 1
                    continue
                finally:
                    window.finished(index)
                if began < window.open:
                    continue  # the ramp's: not steady load
                elapsed = time.perf_counter() - began
                with lock:
                    level.latencies.append(elapsed)
                    level.tokens += tokens
                    level.rounds += int((stats or {}).get("target_calls", 0))
                    level.drafted_rounds += int((stats or {}).get("drafted_rounds", 0))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    level.ramp_s = window.open - start
    level.seconds = time.perf_counter() - window.open  # the window and the requests in flight at its close
    return level


class _Window:
    """A level's measuring window: it opens once `clients` clients have each finished a request (0: at
    `start`), `ramp_limit_s` after the start at the latest, and closes `duration_s` later. Until the
    ramp has ended it reads as opening at that limit, so nothing before its end counts. Thread-safe."""

    def __init__(self, start: float, duration_s: float, clients: int, ramp_limit_s: float):
        self._lock = threading.Lock()
        self._waiting = set(range(clients))
        self._limit, self._duration_s = start + ramp_limit_s, duration_s
        self._opened: float | None = start if clients == 0 else None

    @property
    def open(self) -> float:
        return self._opened if self._opened is not None else self._limit

    @property
    def close(self) -> float:
        return self.open + self._duration_s

    def finished(self, client: int) -> None:
        with self._lock:
            if self._opened is None:
                self._waiting.discard(client)
                if not self._waiting:
                    self._opened = min(time.perf_counter(), self._limit)

    def holds(self, now: float) -> bool:
        return self.open <= now <= self.close
