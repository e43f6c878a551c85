"""Config parsing: every bad value is a ConfigError naming its field; good values become objects."""

import pytest

from cascade_service.config import ConfigError, MaGConfig, parse_config
from cascade_service.core.cascade import Lookup


def _raw(**schedule):
    return {
        "tiers": {
            "target": {"name": "large", "path": "/m/large"},
            "drafters": [{"name": "base", "path": "/m/base"}, {"kind": "mag"}],
        },
        "schedule": schedule,
    }


def test_lookup_and_schedule_parse_into_objects():
    config = parse_config(_raw(k_matrix=[[3, 0], [0, 10]], leniency=2, lookup={"min_match": 3, "tokens": 12}))
    assert config.cascade.lookup == Lookup(3, 12)
    assert config.cascade.schedule.to_lists() == [[3, 0], [0, 10]]
    assert config.cascade.leniency == 2.0
    assert isinstance(config.cascade.drafters[1], MaGConfig)
    assert parse_config(_raw()).cascade.lookup is None  # off unless asked for


@pytest.mark.parametrize(
    "schedule, needle",
    [
        ({"lookup": {"min_match": 0}}, "lookup.min_match"),
        ({"lookup": {"tokens": 1000}}, "lookup.tokens"),
        ({"lookup": {"tokens": True}}, "lookup.tokens"),
        ({"lookup": {"min_len": 2}}, "schedule.lookup.min_len"),
        ({"lookup": [2, 10]}, "schedule.lookup"),
        ({"leniency": 0.5}, "schedule.leniency"),
        ({"k_matrix": [[1, 2], [3, 4]]}, "schedule.k_matrix"),
        ({"beam": 2}, "schedule.beam"),
    ],
)
def test_bad_schedule_values_name_their_field(schedule, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        parse_config(_raw(**schedule))


def test_lookup_without_its_statistical_drafter_is_rejected():
    raw = _raw(lookup={"min_match": 2})
    raw["tiers"]["drafters"] = [{"name": "base", "path": "/m/base"}]
    with pytest.raises(ConfigError, match="schedule.lookup.tier: .mag. is not a statistical drafter"):
        parse_config(raw)


def test_serving_section_parses_and_names_bad_fields():
    raw = _raw()
    raw["serving"] = {
        "grpc_port": 9100,
        "redis_url": "redis://127.0.0.1:6379/0",
        "torch_threads": 1,
        "adapt_to_load": False,
        "freeze_heap": False,
        "load_arms": ["plain", "lookup"],
        "deployments": {"tier-large": {"num_replicas": 2, "ray_actor_options": {"num_gpus": 1}}},
    }
    serving = parse_config(raw).serving
    assert not serving.adapt_to_load and parse_config(_raw()).serving.adapt_to_load  # on by default
    assert not serving.freeze_heap and parse_config(_raw()).serving.freeze_heap  # on by default
    assert serving.load_arms == ("plain", "lookup") and parse_config(_raw()).serving.load_arms is None
    grouped = parse_config({**raw, "serving": {"groups": [["large", "base"]], "deployments": {"tier-large-base": {}}}})
    assert grouped.serving.groups == (("large", "base"),)
    assert serving.grpc_port == 9100 and serving.deployments["tier-large"]["num_replicas"] == 2
    for bad, needle in [
        ({"grpc_port": 0}, "serving.grpc_port"),
        ({"redis_url": "http://x"}, "serving.redis_url"),
        ({"colocate": ["moon"]}, "serving.colocate"),
        ({"colocate": "large"}, "serving.colocate"),
        ({"colocate": ["large"], "deployments": {"tier-large": {}}}, "serving.deployments.tier-large"),
        ({"groups": [["base"], ["base"]]}, "serving.groups"),
        ({"groups": [["mag"]]}, "serving.groups"),
        ({"groups": [["large", "base"]], "deployments": {"tier-base": {}}}, "serving.deployments.tier-base"),
        ({"deployments": {"tier-huge": {}}}, "serving.deployments.tier-huge"),
        ({"deployments": {"coordinator": {"replicas": 2}}}, "serving.deployments.coordinator.replicas"),
        ({"session_namespace": "a:b"}, "serving.session_namespace"),
        ({"port": 1}, "serving.port"),
        ({"adapt_to_load": "yes"}, "serving.adapt_to_load"),
        ({"freeze_heap": 1}, "serving.freeze_heap"),
        ({"load_arms": []}, "serving.load_arms"),
        ({"load_arms": "plain"}, "serving.load_arms"),
        ({"load_arms": ["plain", "plain"]}, "serving.load_arms"),
        ({"load_arms": ["greedy"]}, "serving.load_arms"),
    ]:
        raw["serving"] = bad
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            parse_config(raw)


def test_the_standalone_servers_threads_default_to_torch_threads_and_0_means_every_core():
    import os

    from cascade_service.standalone import standalone_threads

    def threads(**serving):
        raw = _raw()
        raw["serving"] = serving
        return standalone_threads(parse_config(raw).serving)

    assert threads() is None and threads(torch_threads=3) == 3  # unset: as the Ray replicas run
    assert threads(torch_threads=1, standalone_torch_threads=2) == 2
    assert threads(torch_threads=1, standalone_torch_threads=0) == len(os.sched_getaffinity(0))
    for bad in (-1, 1.5, "all", 2000):
        raw = _raw()
        raw["serving"] = {"standalone_torch_threads": bad}
        with pytest.raises(ConfigError, match=r"serving\.standalone_torch_threads"):
            parse_config(raw)


def test_serving_redis_url_reads_braced_environment_references(monkeypatch):
    # The deploy files name the session store as ${CASCADE_REDIS_URL}, set per pod or node.
    raw = _raw()
    raw["serving"] = {"redis_url": "${CASCADE_TEST_REDIS}/3"}
    monkeypatch.setenv("CASCADE_TEST_REDIS", "redis://cascade-redis:6379")
    assert parse_config(raw).serving.redis_url == "redis://cascade-redis:6379/3"
    raw["serving"] = {"redis_url": "redis://:pa$CASCADE_TEST_REDIS@host:6379/0"}  # a bare $ is not a reference
    assert parse_config(raw).serving.redis_url == "redis://:pa$CASCADE_TEST_REDIS@host:6379/0"


@pytest.mark.parametrize("value", [None, ""])
def test_a_redis_url_naming_an_unset_or_empty_variable_is_an_error_not_in_memory_sessions(monkeypatch, value):
    raw = _raw()
    raw["serving"] = {"redis_url": "${CASCADE_TEST_REDIS}"}
    if value is None:
        monkeypatch.delenv("CASCADE_TEST_REDIS", raising=False)
    else:
        monkeypatch.setenv("CASCADE_TEST_REDIS", value)
    with pytest.raises(ConfigError, match=r"serving\.redis_url reads \$\{CASCADE_TEST_REDIS\}, which is not set"):
        parse_config(raw)


def test_an_expanded_redis_url_of_the_wrong_scheme_is_refused_without_echoing_it(monkeypatch):
    raw = _raw()
    raw["serving"] = {"redis_url": "${CASCADE_TEST_REDIS}"}
    monkeypatch.setenv("CASCADE_TEST_REDIS", "http://user:hunter2@host:6379")
    with pytest.raises(ConfigError, match=r"serving\.redis_url must be a redis://") as caught:
        parse_config(raw)
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize("grace", [-1, "x", True, 3601, None])
def test_shutdown_grace_must_be_seconds_in_range(grace):
    with pytest.raises(ConfigError, match=r"serving.shutdown_grace_s must be a number of seconds in \[0, 3600\]"):
        parse_config({**_raw(), "serving": {"shutdown_grace_s": grace}})


def test_shutdown_grace_defaults_to_ten_seconds_and_becomes_each_replicas_graceful_timeout():
    from cascade_service.serving.placement import deployment_options

    assert parse_config(_raw()).serving.shutdown_grace_s == 10.0
    serving = parse_config({**_raw(), "serving": {"shutdown_grace_s": 2.5}}).serving
    assert deployment_options(serving, "coordinator", local=False)["graceful_shutdown_timeout_s"] == 2.5
