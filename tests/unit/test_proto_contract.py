"""The proto documents the contract the server enforces, and follows the usual API lint rules.

A client in another language has only `protos/`: every limit the server checks must be written
there, and must be the number the code uses (these tests read both). The lint rules are the common
ones of `buf lint`'s DEFAULT set that apply to this file.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from cascade_service import coordinator
from cascade_service.core import request
from cascade_service.core.verify import ALPHA_RANGE, CASCADE_RULES, FUZZY_RULES, RULES
from cascade_service.sessions import store

PROTO = Path(__file__).resolve().parents[2] / "protos" / "cascade" / "v1" / "cascade.proto"
REQUESTS = ("GenerateRequest", "Verification", "CreateSessionRequest", "GetSessionRequest", "DeleteSessionRequest")


@pytest.fixture(scope="module")
def described() -> descriptor_pb2.FileDescriptorProto:
    """The proto compiled with its comments (source info), as protoc hands it to other languages' plugins."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = [
            "protoc",
            f"-I{PROTO.parents[2]}",
            f"-I{include}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            "cascade/v1/cascade.proto",
        ]
        assert protoc.main(args) == 0
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return files.file[0]


def _comments(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    return {tuple(loc.path): loc.leading_comments + loc.trailing_comments for loc in file.source_code_info.location}


def _text() -> str:
    """The file with comment markers dropped and whitespace collapsed: comments wrap anywhere."""
    return " ".join(re.sub(r"//", " ", PROTO.read_text()).split())


def test_every_request_field_and_every_rpc_is_documented(described):
    comments = _comments(described)
    undocumented = []
    for m, message in enumerate(described.message_type):
        for f, field in enumerate(message.field):
            # 4 = FileDescriptorProto.message_type, 2 = DescriptorProto.field
            if message.name in REQUESTS and not comments.get((4, m, 2, f), "").strip():
                undocumented.append(f"{message.name}.{field.name}")
    # GetSession/DeleteSession's lone session_id is self-explanatory; everything else says its rule.
    assert set(undocumented) <= {
        "GetSessionRequest.session_id",
        "DeleteSessionRequest.session_id",
        "Verification.rule",
    }, undocumented
    service = described.service[0]
    for i, method in enumerate(service.method):
        assert comments.get((6, 0, 2, i), "").strip() or method.name.endswith("Session"), method.name


@pytest.mark.parametrize(
    "phrase",
    [
        f"max_new_tokens = 4; in [1, {request.MAX_NEW_TOKENS}]",
        f"temperature = 5; in [0, {request.MAX_TEMPERATURE:g}]",
        "top_p = 6; in (0, 1]",
        "seed = 7; in [0, 2^63)",
        f"At most {request.MAX_STOP_STRINGS}, each non-empty and at most {request.MAX_STOP_CHARS} characters",
        f"The prompt is at most {coordinator.MAX_PROMPT_TOKENS:,} tokens",
        "prompt (text) or prompt_token_ids, never both",
        f"Session ids match {store.SESSION_ID_PATTERN}",
        f"a session holds at most {store.MAX_SESSION_TOKENS:,} tokens",
        "outside (0, 1), or when no tier of the cascade has an acceptance head",
        "every int64 here is a count that stays below 2^53",
        "grpc.reflection.v1 and v1alpha",
    ],
)
def test_the_proto_states_each_limit_the_server_enforces(phrase):
    assert phrase in _text()


def test_the_proto_lists_every_verification_rule_and_its_range():
    text = _text()
    for rule in RULES:
        assert f'"{rule}"' in text or (rule.startswith("token-") and '"token-v1/v2/v3"' in text), rule
    assert f'"lossy": [{ALPHA_RANGE["lossy"][0]:g}, {ALPHA_RANGE["lossy"][1]:g})' in text
    low, high = ALPHA_RANGE[CASCADE_RULES[0]]
    assert all(ALPHA_RANGE[r] == (low, high) for r in CASCADE_RULES)
    assert f"[{low:g}, {high:g}] (-1 is exact)" in text
    assert all(ALPHA_RANGE[r] == (0.0, float("inf")) for r in FUZZY_RULES)
    assert '"fuzzy-*": [0, +inf)' in text


def test_only_documented_counters_are_64_bit(described):
    """int64 is read as Long or string in JavaScript; each one here is a counter (< 2^53, as the file says)."""
    counters = {
        f"{m.name}.{f.name}"
        for m in described.message_type
        for f in m.field
        if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_INT64
    }
    assert counters == {
        "TierStats.calls",
        "TierStats.tokens_processed",
        "TierStats.hops",
        "TierStats.drafted",
        "TierStats.accepted",
        "TierStats.tokens_cached",
        "GenerateStats.generated_tokens",
        "GenerateStats.cached_prompt_tokens",
        "GenerateStats.drafted_rounds",
        "GenerateStats.accepted_prediction_tokens",
        "GenerateStats.rejected_prediction_tokens",
        "GenerateStats.target_calls",
        "GenerateStats.accepted_by_position",
        "GenerateStats.drafted_by_position",
        "GenerateStats.off_target_tokens",
        "RowStats.blocks",
        "RowStats.gated",
        "EntryStats.blocks",
        "EntryStats.ended",
        "EntryStats.tokens",
        "GenerateResponse.session_length",
        "GenerateChunk.session_length",
        "Session.version",
    }


def test_lint_rules(described):
    """buf lint DEFAULT rules that apply here: versioned package matching the directory, PascalCase
    messages / services / rpcs, lower_snake_case fields, `<Rpc>Request` inputs. The API's one
    exception (it predates this check and field numbers are stable): GenerateStream takes Generate's
    request, so that a client switches between them without building another message."""
    assert described.package == "cascade.v1" and described.name == "cascade/v1/cascade.proto"
    pascal, snake = re.compile(r"[A-Z][A-Za-z0-9]*"), re.compile(r"[a-z][a-z0-9_]*")
    for message in described.message_type:
        assert pascal.fullmatch(message.name), message.name
        for field in message.field:
            assert snake.fullmatch(field.name) and "__" not in field.name, field.name
    for service in described.service:
        assert pascal.fullmatch(service.name) and service.name.endswith("Service")
        for method in service.method:
            assert pascal.fullmatch(method.name)
            expected = "Generate" if method.name == "GenerateStream" else method.name
            assert method.input_type == f".cascade.v1.{expected}Request", method.name
