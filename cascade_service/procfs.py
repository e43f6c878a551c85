"""Process trees and their listening sockets, read from Linux's /proc.

What the load benchmark measures (the resident memory of the server's processes, found by the port
it listens on) and what the service tests check (no process of the service listens beyond
loopback). Processes come and go while /proc is read: each one that vanishes is skipped.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

PROC = Path("/proc")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses):
    [0] the state, [1] the parent pid, [19] the start time; None once the process is gone."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def processes() -> dict[int, tuple[int, str]]:
    """Every process now: pid -> (parent pid, start time; the pair names a process, a pid alone may be
    reused)."""
    table = {}
    for entry in PROC.glob("[0-9]*"):
        fields = stat_fields(int(entry.name))
        if fields is not None:
            table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def descendants(*roots: int) -> set[int]:
    """`roots` and every process below them."""
    parents = {pid: ppid for pid, (ppid, _) in processes().items()}
    tree, grew = set(roots), True
    while grew:
        children = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= children
        grew = bool(children)
    return tree


def listening_sockets() -> dict[str, tuple[Address, int]]:
    """socket inode -> (host, port) of every TCP socket listening on this machine."""
    sockets = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / name).read_text().splitlines()[1:]
        except OSError:  # no IPv6 here
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != "0A":  # TCP_LISTEN
                continue
            host_hex, port_hex = cols[1].split(":")
            sockets[cols[9]] = (_host(host_hex), int(port_hex, 16))
    return sockets


def socket_inodes(pid: int) -> list[str]:
    """The inodes of the sockets `pid` holds open ([] if it is gone or not ours to read)."""
    try:
        fds = list((PROC / str(pid) / "fd").iterdir())
    except OSError:
        return []
    inodes = []
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:  # closed meanwhile (the listing's own descriptor, for one)
            continue
        if link.startswith("socket:["):
            inodes.append(link[8:-1])
    return inodes


def listeners(pids: set[int]) -> list[tuple[Address, int, int]]:
    """(host, port, pid) of every listening TCP socket held by one of `pids`."""
    sockets = listening_sockets()
    return [(*sockets[inode], pid) for pid in pids for inode in socket_inodes(pid) if inode in sockets]


def listener_of(port: int) -> int | None:
    """The pid of a process listening on TCP `port` here; None if there is none."""
    inodes = {inode for inode, (_, p) in listening_sockets().items() if p == port}
    if not inodes:
        return None
    for pid_dir in PROC.glob("[0-9]*"):
        if inodes.intersection(socket_inodes(int(pid_dir.name))):
            return int(pid_dir.name)
    return None


def rss_bytes(pids: set[int]) -> int:
    """The resident memory of `pids` together, in bytes."""
    total = 0
    for pid in pids:
        try:
            for line in (PROC / str(pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def beyond_loopback(found: list[tuple[Address, int, int]]) -> list[tuple[str, int, str]]:
    """(host, port, command) of each of `found` (what `listeners` returns) not bound to loopback."""
    return [(str(host), port, command(pid)) for host, port, pid in found if not is_loopback(host)]


def is_loopback(host: Address) -> bool:
    mapped = getattr(host, "ipv4_mapped", None)  # gRPC's dual-stack [::ffff:127.0.0.1]
    return host.is_loopback or (mapped is not None and mapped.is_loopback)


def command(pid: int) -> str:
    """The start of `pid`'s command line, for messages ("?" if it is gone)."""
    try:
        return (PROC / str(pid) / "cmdline").read_text().replace("\0", " ")[:80]
    except OSError:
        return "?"


def _host(hex_addr: str) -> Address:
    raw = bytes.fromhex(hex_addr)
    # /proc/net prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)
