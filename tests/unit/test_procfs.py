"""cascade_service.procfs against sockets and processes this test makes itself."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys

import pytest

from cascade_service import procfs
from cascade_service.bench.load import listener_tree_rss


@pytest.fixture
def child():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process.pid
    process.kill()
    process.wait()


def _listen(family: int, host: str) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock


def test_a_loopback_listener_is_found_with_its_owner_and_its_tree(child):
    with _listen(socket.AF_INET, "127.0.0.1") as sock:
        port = sock.getsockname()[1]
        assert procfs.listener_of(port) == os.getpid()
        tree = procfs.descendants(os.getpid())
        assert {os.getpid(), child} <= tree
        assert (ipaddress.ip_address("127.0.0.1"), port, os.getpid()) in procfs.listeners(tree)
        assert procfs.listeners({child}) == []  # the child holds no listening socket
        assert procfs.rss_bytes({os.getpid()}) > 0
        # The whole tree's memory, the child's included. The suite's other children (a Redis server,
        # say) are in the tree too, and RSS moves between reads: read the tree before and after.
        slack = procfs.rss_bytes({child}) / 2
        before = procfs.rss_bytes(procfs.descendants(os.getpid()))
        tree_rss = listener_tree_rss(port)
        after = procfs.rss_bytes(procfs.descendants(os.getpid()))
        assert min(before, after) - slack < tree_rss < max(before, after) + slack
    assert procfs.listener_of(port) is None  # closed: nobody listens there any more
    assert listener_tree_rss(port) is None


@pytest.mark.parametrize(
    "hex_addr, address",
    [
        ("0100007F", "127.0.0.1"),  # /proc/net/tcp: one little-endian word
        ("00000000000000000000000001000000", "::1"),  # /proc/net/tcp6: four of them
        ("0000000000000000FFFF00000100007F", "::ffff:127.0.0.1"),  # how gRPC's dual-stack loopback shows
        ("00000000000000000000000000000000", "::"),
    ],
)
def test_proc_net_addresses_are_read_word_by_word(hex_addr, address):
    assert procfs._host(hex_addr) == ipaddress.ip_address(address)


def test_a_vanished_process_reads_as_nothing(child):
    gone = max(procfs.descendants(1) | {child}) + 100_000  # no such pid
    assert procfs.socket_inodes(gone) == []
    assert procfs.rss_bytes({gone}) == 0
    assert procfs.command(gone) == "?"
    assert "time.sleep" in procfs.command(child)


@pytest.mark.parametrize(
    "address, loopback",
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("::ffff:10.0.0.5", False),
    ],
)
def test_loopback_includes_ipv4_mapped_loopback_and_nothing_else(address, loopback):
    assert procfs.is_loopback(ipaddress.ip_address(address)) is loopback


def test_only_listeners_beyond_loopback_are_reported():
    # Servers here may bind loopback only, so wildcard listeners are stood in for, not opened.
    me = os.getpid()
    found = [
        (ipaddress.ip_address("127.0.0.1"), 1001, me),
        (ipaddress.ip_address("0.0.0.0"), 1002, me),
        (ipaddress.ip_address("::ffff:127.0.0.1"), 1003, me),
        (ipaddress.ip_address("::"), 1004, me),
    ]
    assert procfs.beyond_loopback(found) == [("0.0.0.0", 1002, procfs.command(me)), ("::", 1004, procfs.command(me))]
