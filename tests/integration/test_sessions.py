"""Session stores: both backends keep one contract (checked against a real redis-server), and the Redis
one adds namespacing, sharing across store objects, and StoreUnavailable instead of hangs."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from cascade_service.sessions import (
    MAX_SESSION_TOKENS,
    MemoryStore,
    SessionConflict,
    SessionExists,
    SessionNotFound,
    SessionQuotaExceeded,
    SessionRecord,
    SessionStore,
    StoreUnavailable,
    check_session_id,
    new_session_id,
)
from cascade_service.sessions.redis_store import RedisStore, redact_url

from ..redis_server import RedisServer

MakeStore = Callable[..., SessionStore]


def _namespace() -> str:
    # A fresh namespace per store keeps tests sharing one server from seeing each other's sessions.
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture(params=["memory", "redis"])
def make_store(request) -> Iterator[MakeStore]:
    """`make_store(ttl_s=None)` -> a fresh, empty store of the parametrized backend."""
    opened: list[RedisStore] = []

    def make(ttl_s: int | None = None) -> SessionStore:
        if request.param == "memory":
            return MemoryStore(ttl_s=ttl_s)
        server = request.getfixturevalue("redis_server")
        store = RedisStore(server.url, namespace=_namespace(), ttl_s=ttl_s)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def store(make_store) -> SessionStore:
    return make_store()


# --- the contract, on both backends ---


def test_create_get_append_delete_round_trip(store):
    created = store.create([1, 2, 3], owner="key-1")
    assert created == SessionRecord(created.session_id, (1, 2, 3), 0, "key-1")
    check_session_id(created.session_id)
    assert store.get(created.session_id) == created

    appended = store.append(created.session_id, [4, 5], expected_version=0)
    assert appended == SessionRecord(created.session_id, (1, 2, 3, 4, 5), 1, "key-1")
    assert store.get(created.session_id) == appended
    assert store.append(created.session_id, [], expected_version=1).version == 2  # an empty append is one

    assert store.delete(created.session_id) is True
    assert store.delete(created.session_id) is False
    with pytest.raises(SessionNotFound, match=repr(created.session_id)):
        store.get(created.session_id)


def test_token_ids_round_trip_at_the_uint32_edges_and_owner_text_survives(store):
    tokens = [0, 1, 255, 256, 65535, 65536, 2**31 - 1]
    record = store.create(tokens, owner="clé-ü")
    assert store.get(record.session_id).token_ids == tuple(tokens)
    assert store.get(record.session_id).owner == "clé-ü"
    assert store.create().token_ids == () and store.create().owner == ""


def test_create_with_explicit_id_and_duplicate_id_raises_session_exists(store):
    record = store.create([7], session_id="conv:42_a.b-c")
    assert record.session_id == "conv:42_a.b-c"
    with pytest.raises(SessionExists):
        store.create([8], session_id="conv:42_a.b-c")
    assert store.get("conv:42_a.b-c").token_ids == (7,)  # never overwritten


def test_append_with_stale_version_conflicts_and_changes_nothing(store):
    record = store.create([1])
    current = store.append(record.session_id, [2], expected_version=0)
    for stale in (0, 2, 99):
        with pytest.raises(SessionConflict):
            store.append(record.session_id, [3], expected_version=stale)
    assert store.get(record.session_id) == current


def test_missing_session_not_found_on_get_and_append_false_on_delete(store):
    with pytest.raises(SessionNotFound, match="session 'nope' not found"):
        store.get("nope")
    with pytest.raises(SessionNotFound):
        store.append("nope", [1], expected_version=0)
    assert store.delete("nope") is False


def test_concurrent_appends_with_retry_keep_every_token_exactly_once(store):
    threads_n, appends_each = 8, 15
    session_id = store.create().session_id
    start = threading.Barrier(threads_n)
    conflicts = [0] * threads_n
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            start.wait()
            for step in range(appends_each):
                token = index * 1000 + step
                while True:
                    version = store.get(session_id).version
                    try:
                        store.append(session_id, [token, token], expected_version=version)
                        break
                    except SessionConflict:
                        conflicts[index] += 1
        except BaseException as exc:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=60)
    assert not errors, errors
    final = store.get(session_id)
    expected = sorted(i * 1000 + s for i in range(threads_n) for s in range(appends_each) for _ in range(2))
    assert sorted(final.token_ids) == expected
    # each append's two tokens stay adjacent: appends never interleave
    assert all(final.token_ids[i] == final.token_ids[i + 1] for i in range(0, len(final.token_ids), 2))
    assert final.version == threads_n * appends_each


def test_sessions_expire_after_ttl_and_append_refreshes_it(make_store):
    store = make_store(ttl_s=1)
    kept = store.create([1])
    dropped = store.create([2])
    time.sleep(0.6)
    store.append(kept.session_id, [3], expected_version=0)  # refreshes kept's TTL to a full second
    time.sleep(0.6)
    assert store.get(kept.session_id).token_ids == (1, 3)
    with pytest.raises(SessionNotFound):
        store.get(dropped.session_id)
    store.create([9], session_id=dropped.session_id)  # an expired id is free again
    time.sleep(1.1)
    with pytest.raises(SessionNotFound):
        store.get(kept.session_id)


@pytest.mark.parametrize("bad_id", ["", "-leading-dash", "_x", "a" * 129, "has space", "a/b", "a*", "é", "ok\n", 7])
def test_bad_session_ids_raise_value_error_everywhere(store, bad_id):
    with pytest.raises(ValueError, match="session_id must match"):
        store.create([1], session_id=bad_id)
    for call in (store.get, store.delete, lambda sid: store.append(sid, [1], 0)):
        with pytest.raises(ValueError, match="session_id must match"):
            call(bad_id)


def test_longest_valid_session_id_is_accepted(store):
    assert store.create(session_id="a" * 128).session_id == "a" * 128


@pytest.mark.parametrize("bad_tokens", [[-1], [2**31], [1.0], ["1"], [True], [None], "123", b"12"])
def test_bad_token_ids_raise_value_error_and_change_nothing(store, bad_tokens):
    with pytest.raises(ValueError):
        store.create(bad_tokens)
    record = store.create([5])
    with pytest.raises(ValueError):
        store.append(record.session_id, [6, *bad_tokens] if isinstance(bad_tokens, list) else bad_tokens, 0)
    assert store.get(record.session_id) == record


def test_sessions_are_capped_at_max_session_tokens(store):
    with pytest.raises(ValueError):
        store.create([0] * (MAX_SESSION_TOKENS + 1))
    record = store.create([1] * (MAX_SESSION_TOKENS - 1))
    with pytest.raises(ValueError, match="limit"):
        store.append(record.session_id, [2, 3], expected_version=0)
    assert store.get(record.session_id).version == 0
    assert len(store.append(record.session_id, [2], expected_version=0).token_ids) == MAX_SESSION_TOKENS


def test_new_session_ids_match_the_pattern_and_differ():
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000
    for session_id in ids:
        check_session_id(session_id)


def test_memory_store_sweeps_expired_sessions_nobody_reads_again():
    store = MemoryStore(ttl_s=0.05)
    for _ in range(10):
        store.create([1])
    time.sleep(0.1)
    store.create([2])
    assert len(store._sessions) == 1


# --- Redis specifics ---


def test_redis_keys_are_namespaced_hashes_and_namespaces_do_not_see_each_other():
    with RedisServer() as server:
        a = RedisStore(server.url, namespace="alpha", ttl_s=None)
        b = RedisStore(server.url, namespace="beta", ttl_s=60)
        a.create([1, 2], session_id="shared")
        b.create([3], session_id="shared")  # same id, other namespace: no SessionExists
        a.create([4])
        raw = redis.Redis.from_url(server.url)
        keys = sorted(key.decode() for key in raw.keys("*"))
        assert len(keys) == 3 and keys[1:] == ["alpha:session:shared", "beta:session:shared"]
        assert keys[0].startswith("alpha:session:s-")
        assert a.get("shared").token_ids == (1, 2) and b.get("shared").token_ids == (3,)
        assert raw.hgetall("alpha:session:shared") == {
            b"tokens": (1).to_bytes(4, "little") + (2).to_bytes(4, "little"),
            b"version": b"0",
            b"owner": b"",
        }
        assert raw.ttl("alpha:session:shared") == -1 and 0 < raw.ttl("beta:session:shared") <= 60
        assert b.delete("shared") and a.get("shared").version == 0
        with pytest.raises(ValueError, match="namespace"):
            RedisStore(server.url, namespace="a:session")
        for client in (raw, a, b):
            client.close()


def test_a_new_redis_store_object_sees_sessions_written_by_an_old_one(redis_server):
    namespace = _namespace()
    old = RedisStore(redis_server.url, namespace=namespace)
    record = old.append(old.create([1, 2], owner="k").session_id, [3], expected_version=0)
    old.close()
    restarted = RedisStore(redis_server.url, namespace=namespace)  # a restarted service, same server
    assert restarted.get(record.session_id) == record
    restarted.close()


def _assert_fast_unavailable(call: Callable[[], object], must_name: str, limit_s: float = 3.0) -> str:
    began = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        call()
    assert time.monotonic() - began < limit_s
    assert must_name in str(caught.value)
    return str(caught.value)


def test_redis_down_raises_store_unavailable_fast_then_recovers_after_restart():
    with RedisServer() as server:
        store = RedisStore(server.url, namespace=_namespace(), socket_timeout_s=1.0)
        record = store.create([1])
        store.ping()
        server.stop()
        where = f"127.0.0.1:{server.port}"
        for call in (
            store.ping,
            lambda: store.create([1]),
            lambda: store.get(record.session_id),
            lambda: store.append(record.session_id, [2], 0),
            lambda: store.delete(record.session_id),
        ):
            _assert_fast_unavailable(call, where)
        server.start()  # same port; `--save ""`: the data is gone, but the same store object works again
        store.ping()
        with pytest.raises(SessionNotFound):
            store.get(record.session_id)
        again = store.create([5], session_id=record.session_id)
        assert store.append(again.session_id, [6], 0).token_ids == (5, 6)
        store.close()


def test_store_unavailable_message_hides_the_password():
    with RedisServer() as server:
        server.stop()
        for url in (
            f"redis://:s3cret@127.0.0.1:{server.port}/0",
            f"redis://user:s3cret@127.0.0.1:{server.port}/0",
            f"redis://127.0.0.1:{server.port}/0?password=s3cret",
        ):
            store = RedisStore(url, namespace=_namespace(), socket_timeout_s=1.0)
            message = _assert_fast_unavailable(store.ping, f"127.0.0.1:{server.port}")
            assert "s3cret" not in message and "s3cret" not in store.display_url
    assert redact_url("redis://localhost:6379/0") == "redis://localhost:6379/0"


def test_redis_that_stops_answering_times_out_into_store_unavailable():
    with RedisServer() as server:
        store = RedisStore(server.url, namespace=_namespace(), socket_timeout_s=0.3)
        store.ping()
        os.kill(server.pid, signal.SIGSTOP)  # accepts nothing, answers nothing: a hung server
        try:
            _assert_fast_unavailable(store.ping, f"127.0.0.1:{server.port}", limit_s=2.0)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        store.ping()
        store.close()


def test_importing_the_sessions_package_does_not_import_redis():
    import subprocess
    import sys

    probe = "import sys, cascade_service.sessions; print('redis' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_store_errors_keep_their_message_across_processes():
    """Ray pickles a session actor's exception to the coordinator; the client must see the same text."""
    import pickle

    from cascade_service.sessions import SessionExists, SessionNotFound

    for error in (SessionNotFound("s-1"), SessionExists("session 's-1' already exists")):
        again = pickle.loads(pickle.dumps(error))
        assert (type(again), str(again)) == (type(error), str(error))


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_an_owner_holds_at_most_its_quota_of_live_sessions(kind, redis_server):
    if kind == "memory":
        store: Any = MemoryStore(ttl_s=1.0, max_sessions_per_owner=2)
    else:
        store = RedisStore(
            redis_server.url, namespace=f"quota-{uuid.uuid4().hex[:8]}", ttl_s=1, max_sessions_per_owner=2
        )
    alice, bob = "a" * 32, "b" * 32
    first = store.create([1], owner=alice)
    store.create([2], owner=alice)
    with pytest.raises(SessionQuotaExceeded) as caught:
        store.create([3], owner=alice)
    assert str(caught.value) == "this API key holds 2 sessions, its limit; delete one or wait for one to expire"
    store.create([4], owner=bob)  # another owner has a quota of its own
    store.create([5])  # and so do anonymous callers
    assert store.delete(first.session_id)
    store.create([6], owner=alice)  # a deleted session frees its place
    time.sleep(1.3)  # every session expires with the TTL
    store.create([7], owner=alice)
    store.create([8], owner=alice)
