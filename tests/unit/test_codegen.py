"""The committed gRPC stubs are exactly what protos/ generates (so no one edits them by hand or forgets)."""

from cascade_service.proto import codegen


def test_committed_stubs_match_the_protos():
    assert codegen.main(["--check"]) == 0, "stale stubs: run `python -m cascade_service.proto.codegen`"


def test_the_check_fails_on_a_stale_stub(tmp_path, monkeypatch):
    for name, text in codegen.generate().items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(codegen, "STUBS_DIR", tmp_path)
    assert codegen.main(["--check"]) == 0
    (tmp_path / "tier" / "v1" / "tier_pb2.py").write_text("# edited by hand\n")
    assert codegen.main(["--check"]) == 1


def test_message_classes_pickle_by_reference():
    # Ray moves messages between processes by pickling; the module name must be importable.
    import pickle

    from cascade_service.proto.v1 import cascade_pb2 as pb

    assert pb.GenerateRequest.__module__ == "cascade_service.proto.v1.cascade_pb2"
    request = pb.GenerateRequest(prompt="x", max_new_tokens=3)
    assert pickle.loads(pickle.dumps(request)) == request
    from cascade_service.proto.tier.v1 import tier_pb2

    assert tier_pb2.DraftRequest.__module__ == "cascade_service.proto.tier.v1.tier_pb2"
