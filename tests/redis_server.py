"""A throwaway real redis-server for tests: loopback only, no persistence, its own temp dir."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

INSTALL_HINT = "apt-get install -y redis-server"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """`with RedisServer() as server: RedisStore(server.url)`. stop() then start() restarts it on the
    same port (empty: nothing is saved); close() stops it for good and removes its directory."""

    def __init__(self, port: int | None = None, start_timeout_s: float = 10.0) -> None:
        self._binary = shutil.which("redis-server")
        if self._binary is None:
            # Never a skip: CI installs redis-server, and a silently skipped store test hides a broken store.
            raise RuntimeError(f"redis-server is not on PATH; install it: {INSTALL_HINT}")
        self.port = port or _free_port()
        self._start_timeout_s = start_timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="cascade-redis-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("redis-server is not running")
        return self._process.pid

    def start(self) -> RedisServer:
        if self._process is not None:
            return self
        log = self._dir / "redis.log"
        # fmt: off
        command = [
            self._binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self._dir),
            "--logfile", str(log), "--daemonize", "no",
        ]
        # fmt: on
        self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + self._start_timeout_s
        while not _pings(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{tail}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
