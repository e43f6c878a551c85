"""Which replica a request goes to: sticky per request, spread over replicas, and a name that
resolves to several addresses (a headless Service) standing for each of them."""

from __future__ import annotations

import socket
from collections import Counter

from cascade_service.transport import client
from cascade_service.transport.client import TierReplicas


def test_each_request_has_its_own_stable_order_and_requests_spread():
    replicas = TierReplicas(["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"])
    assert replicas.order("r-1") == replicas.order("r-1")
    firsts = Counter(replicas.order(f"r-{i}")[0] for i in range(600))
    assert set(firsts) == set(replicas.addresses) and min(firsts.values()) > 150


def test_a_replica_leaving_moves_only_its_own_requests():
    three = TierReplicas(["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"])
    two = TierReplicas(["127.0.0.1:7001", "127.0.0.1:7002"])
    for i in range(200):
        before = three.order(f"r-{i}")[0]
        if before != "127.0.0.1:7003":
            assert two.order(f"r-{i}")[0] == before


def test_a_name_with_several_addresses_is_one_replica_per_address(monkeypatch):
    def resolve(host, port, family=0, kind=0):
        ips = {"tier-base": ["10.0.0.7", "10.0.0.5"], "single": ["10.0.0.9"]}[host]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ips]

    monkeypatch.setattr(client.socket, "getaddrinfo", resolve)
    assert client._replicas("tier-base:7000") == [("10.0.0.5:7000", "tier-base"), ("10.0.0.7:7000", "tier-base")]
    assert client._replicas("single:7000") == [("single:7000", "single")]
    assert TierReplicas(["tier-base:7000"]).addresses == ("10.0.0.5:7000", "10.0.0.7:7000")
