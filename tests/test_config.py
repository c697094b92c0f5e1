"""Settings, value parsing, identity and machine facts."""

from __future__ import annotations

import dataclasses
import re
import threading
import tomllib
from pathlib import Path

import pytest

from meshnode import identity, sysinfo
from meshnode.config import (
    ConfigError,
    Settings,
    default_cache_dir,
    default_state_dir,
    load_settings,
    parse_duration,
    parse_size,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOML = ROOT / "configs" / "default.toml"
EXAMPLE_TOML = ROOT / "configs" / "example-mesh.toml"


def write(tmp_path: Path, text: str, name: str = "meshnode.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- sizes and durations


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", 0),
        ("123", 123),
        (4096, 4096),
        ("1_000", None),
        ("10B", 10),
        ("1K", 1024),
        ("1k", 1024),
        ("1KiB", 1024),
        ("1kib", 1024),
        ("1KB", 1000),
        ("1kb", 1000),
        ("512M", 512 * 1024**2),
        ("512MiB", 512 * 1024**2),
        ("512MB", 512 * 1000**2),
        ("2G", 2 * 1024**3),
        ("2GiB", 2 * 1024**3),
        ("2GB", 2 * 1000**3),
        ("1T", 1024**4),
        ("1TiB", 1024**4),
        ("1TB", 1000**4),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("1.5G", 3 * 1024**3 // 2),
        (" 16 GiB ", 16 * 1024**3),
        (".5K", 512),
        ("", None),
        ("G", None),
        ("-1", None),
        (-1, None),
        ("12X", None),
        ("1.2.3M", None),
        ("1PiB", None),
        ("ten", None),
        (True, None),
    ],
)
def test_parse_size(text, expected):
    if expected is None:
        with pytest.raises(ValueError):
            parse_size(text)
    else:
        assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [(2, 2.0), (0.5, 0.5), ("0.5", 0.5), ("2s", 2.0), ("500ms", 0.5), (" 1.5 s", 1.5), ("abc", None), ("inf", None)],
)
def test_parse_duration(text, expected):
    if expected is None:
        with pytest.raises(ValueError):
            parse_duration(text)
    else:
        assert parse_duration(text) == pytest.approx(expected)


# --------------------------------------------------------------------------- default.toml


def test_default_toml_documents_every_field():
    data = tomllib.loads(DEFAULT_TOML.read_text())
    fields = [f.name for f in dataclasses.fields(Settings)]
    assert sorted(data) == sorted(fields)
    # every key has a comment right above it
    lines = DEFAULT_TOML.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^([a-z_]+)\s*=", line)
        if m:
            assert i > 0 and lines[i - 1].startswith("#"), f"{m.group(1)} has no comment above it"


def test_default_toml_gives_the_dataclass_defaults():
    assert load_settings(DEFAULT_TOML, env={}) == Settings()


def test_no_file_no_env_gives_defaults():
    assert load_settings(env={}) == Settings()


def test_example_config_loads():
    s = load_settings(EXAMPLE_TOML, env={})
    assert s.memory_budget == 20 * 1024**3
    assert s.peers == ("mac-studio.local:8471", "192.168.1.23:8471")
    assert s.max_context == 8192


# --------------------------------------------------------------------------- precedence


def test_precedence_file_env_flags(tmp_path):
    cfg = write(tmp_path, 'http_port = 9000\ngrpc_port = 9001\nmodel = "from-file"\nmdns = false\nmax_context = 100\n')
    env = {"MESHNODE_GRPC_PORT": "9101", "MESHNODE_MODEL": "from-env", "MESHNODE_MDNS": "yes"}
    flags = {"model": "from-flag", "http_port": None, "grpc_port": None, "mdns": None, "max_context": None}
    s = load_settings(cfg, env=env, flags=flags)
    assert s.http_port == 9000  # file only
    assert s.grpc_port == 9101  # env beats file
    assert s.model == "from-flag"  # flag beats env and file
    assert s.mdns is True  # env beats file; flag None = not given
    assert s.max_context == 100
    assert s.log_level == "INFO"  # default


def test_flags_beat_env_for_every_kind(tmp_path):
    env = {"MESHNODE_PEERS": "10.0.0.1:1, 10.0.0.2:2", "MESHNODE_MEMORY_BUDGET": "1G", "MESHNODE_MDNS": "1"}
    s = load_settings(env=env)
    assert s.peers == ("10.0.0.1:1", "10.0.0.2:2")
    assert s.memory_budget == 1024**3
    s = load_settings(env=env, flags={"peers": ["h:5"], "memory_budget": "2GB", "mdns": False})
    assert s.peers == ("h:5",)
    assert s.memory_budget == 2 * 1000**3
    assert s.mdns is False


def test_config_file_from_environment(tmp_path):
    cfg = write(tmp_path, "http_port = 1234\n")
    assert load_settings(env={"MESHNODE_CONFIG": str(cfg)}).http_port == 1234


def test_env_other_meshnode_vars_ignored():
    assert load_settings(env={"MESHNODE_SOMETHING_ELSE": "x"}) == Settings()


def test_empty_string_means_unset(tmp_path):
    cfg = write(tmp_path, 'model = "m"\ncluster_key = "k"\nmemory_budget = "4G"\n')
    s = load_settings(cfg, env={"MESHNODE_MODEL": "", "MESHNODE_CLUSTER_KEY": "", "MESHNODE_MEMORY_BUDGET": "auto"})
    assert s.model is None and s.cluster_key is None and s.memory_budget is None


def test_relative_paths_in_file_are_relative_to_it(tmp_path):
    cfg = write(tmp_path, 'state_dir = "state"\ncache_dir = "/abs/cache"\n')
    s = load_settings(cfg, env={})
    assert s.state_dir == tmp_path / "state"
    assert s.cache_dir == Path("/abs/cache")
    assert s.resolved_state_dir() == tmp_path / "state"


def test_types_from_toml(tmp_path):
    cfg = write(
        tmp_path,
        'memory_fraction = 1\nheartbeat_interval = "250ms"\nfailure_timeout = 3\nmax_body_bytes = "2MiB"\n'
        'peers = ["[::1]:8471", "a.local:1"]\nlog_level = "debug"\nmemory_budget = 1000000\n',
    )
    s = load_settings(cfg, env={})
    assert s.memory_fraction == 1.0 and isinstance(s.memory_fraction, float)
    assert s.heartbeat_interval == pytest.approx(0.25)
    assert s.failure_timeout == 3.0 and isinstance(s.failure_timeout, float)
    assert s.max_body_bytes == 2 * 1024**2
    assert s.peers == ("[::1]:8471", "a.local:1")
    assert s.log_level == "DEBUG"
    assert s.memory_budget == 1_000_000


# --------------------------------------------------------------------------- errors


def test_unknown_key_in_file(tmp_path):
    cfg = write(tmp_path, "http_prot = 1\n")
    with pytest.raises(ConfigError) as err:
        load_settings(cfg, env={})
    msg = str(err.value)
    assert "http_prot" in msg and str(cfg) in msg and "http_port" in msg  # suggestion


def test_section_in_file_is_an_error(tmp_path):
    cfg = write(tmp_path, "[node]\nhttp_port = 1\n")
    with pytest.raises(ConfigError, match="node"):
        load_settings(cfg, env={})


def test_missing_and_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(write(tmp_path, "http_port = = 1\n"), env={})


@pytest.mark.parametrize(
    "key, value",
    [
        ("http_port", "70000"),
        ("http_port", "abc"),
        ("grpc_port", "-1"),
        ("memory_fraction", "0"),
        ("memory_fraction", "1.5"),
        ("memory_budget", "lots"),
        ("memory_budget", "0"),
        ("max_context", "-1"),
        ("mdns", "maybe"),
        ("heartbeat_interval", "0"),
        ("failure_timeout", "soon"),
        ("peers", "hostwithoutport"),
        ("peers", "h:99999"),
        ("peers", "::1:80"),
        ("log_level", "LOUD"),
        ("node_id", "has space"),
        ("host", ""),
        ("max_body_bytes", "0"),
    ],
)
def test_bad_values_name_key_and_source(tmp_path, key, value):
    env_var = "MESHNODE_" + key.upper()
    with pytest.raises(ConfigError) as err:
        load_settings(env={env_var: value})
    assert env_var in str(err.value)
    flag = "--" + key.replace("_", "-")
    with pytest.raises(ConfigError) as err:
        load_settings(env={}, flags={key: value})
    assert flag in str(err.value)
    cfg = write(tmp_path, f"{key} = {value!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError) as err:
        load_settings(cfg, env={})
    assert str(cfg) in str(err.value) and repr(key) in str(err.value)


def test_bad_toml_type(tmp_path):
    with pytest.raises(ConfigError, match="http_port"):
        load_settings(write(tmp_path, "http_port = true\n"), env={})
    with pytest.raises(ConfigError, match="model"):
        load_settings(write(tmp_path, "model = 3\n"), env={})


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="default_max_tokens"):
        load_settings(env={"MESHNODE_DEFAULT_MAX_TOKENS": "100"}, flags={"max_tokens_limit": 50})
    with pytest.raises(ConfigError, match="failure_timeout"):
        load_settings(env={"MESHNODE_FAILURE_TIMEOUT": "0.1"})
    with pytest.raises(ConfigError):
        Settings(default_max_tokens=10, max_tokens_limit=5)


def test_unknown_flag_name():
    with pytest.raises(ConfigError, match="bogus"):
        load_settings(env={}, flags={"bogus": 1})


def test_direct_construction_validates_and_normalises(tmp_path):
    s = Settings(peers=["a:1"], state_dir=str(tmp_path), memory_budget="1K", log_level="warn")
    assert s.peers == ("a:1",) and s.state_dir == tmp_path and s.memory_budget == 1024
    assert s.log_level == "WARNING"
    with pytest.raises(ConfigError, match="http_port"):
        Settings(http_port=-5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.http_port = 1  # type: ignore[misc]


# --------------------------------------------------------------------------- secrets and dirs


def test_secrets_are_not_shown():
    s = Settings(cluster_key="sekrit-cluster", api_key="sekrit-api")
    assert "sekrit" not in repr(s)
    red = s.redacted()
    assert "sekrit" not in str(red)
    assert red["cluster_key"] == "<redacted>" and red["api_key"] == "<redacted>"
    assert set(red) == {f.name for f in dataclasses.fields(Settings)}
    assert Settings().redacted()["cluster_key"] is None
    import json

    json.dumps(Settings(state_dir="/x", peers=("a:1",)).redacted())


def test_platform_default_dirs(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.platform", "linux")
    assert default_state_dir({"XDG_STATE_HOME": str(tmp_path)}) == tmp_path / "meshnode"
    assert default_state_dir({}) == Path.home() / ".local" / "state" / "meshnode"
    assert default_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "meshnode"
    assert default_cache_dir({}) == Path.home() / ".cache" / "meshnode"
    monkeypatch.setattr("sys.platform", "darwin")
    assert default_state_dir({}) == Path.home() / "Library" / "Application Support" / "meshnode"
    assert default_cache_dir({}) == Path.home() / "Library" / "Caches" / "meshnode"


def test_resolved_dirs(tmp_path):
    s = Settings(state_dir=tmp_path / "s", cache_dir=tmp_path / "c")
    assert s.resolved_state_dir() == tmp_path / "s"
    assert s.resolved_cache_dir() == tmp_path / "c"
    assert Settings().resolved_state_dir() == default_state_dir()
    assert Settings().resolved_cache_dir() == default_cache_dir()


# --------------------------------------------------------------------------- identity


def test_node_id_is_created_once_and_stable(tmp_path):
    state = tmp_path / "state"
    first = identity.load_or_create_node_id(state, None)
    assert re.fullmatch(r"(mac|linux|node)-[a-z0-9-]+-[0-9a-f]{6}", first)
    assert (state / "node_id").read_text().strip() == first
    assert identity.load_or_create_node_id(state, None) == first
    assert [p.name for p in state.iterdir()] == ["node_id"]  # no temp files left


def test_configured_node_id_wins(tmp_path):
    assert identity.load_or_create_node_id(tmp_path, "my-node") == "my-node"
    assert not (tmp_path / "node_id").exists()


def test_invalid_node_id_file_is_replaced(tmp_path):
    (tmp_path / "node_id").write_text("not valid!!\n")
    new = identity.load_or_create_node_id(tmp_path, None)
    assert new != "not valid!!"
    assert identity.load_or_create_node_id(tmp_path, None) == new


def test_racing_processes_agree_on_one_id(tmp_path):
    results: list[str] = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        results.append(identity.load_or_create_node_id(tmp_path, None))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    assert (tmp_path / "node_id").read_text().strip() == results[0]


def test_unwritable_state_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(identity.IdentityError, match="node id"):
        identity.load_or_create_node_id(blocker / "state", None)


def test_cluster_id_properties():
    a = identity.cluster_id("correct horse battery staple")
    assert a == identity.cluster_id("correct horse battery staple")
    assert a != identity.cluster_id("correct horse battery stapler")
    assert re.fullmatch(r"[0-9a-f]{16}", a)
    assert "horse" not in a
    assert identity.cluster_id(None) == "open"
    assert identity.cluster_id("") == "open"
    for key in ("abc", "0123456789abcdef", "x" * 100):
        assert key not in identity.cluster_id(key)


# --------------------------------------------------------------------------- sysinfo


def test_memory_facts():
    total = sysinfo.total_memory()
    avail = sysinfo.available_memory()
    assert total > 0 and 0 < avail <= total
    assert sysinfo.cpu_count() >= 1
    assert sysinfo.platform_name() in ("linux", "macos")


def test_memory_budget():
    assert sysinfo.memory_budget(Settings(memory_budget="3G")) == 3 * 1024**3
    budget = sysinfo.memory_budget(Settings(memory_fraction=0.5))
    assert 0 < budget <= sysinfo.total_memory()


def test_compute_figure_is_quick_and_cached():
    import time

    first = sysinfo.compute_figure()
    assert first > 0
    t0 = time.perf_counter()
    assert sysinfo.compute_figure() == first
    assert time.perf_counter() - t0 < 0.01


def test_compute_figure_measurement_is_fast():
    import time

    sysinfo.compute_figure()  # import mlx and warm up once
    t0 = time.perf_counter()
    value = sysinfo._measure_matmul()
    assert time.perf_counter() - t0 < 0.3
    assert value > 0


def test_a_renamed_setting_is_read_under_its_old_name_with_a_warning(tmp_path, caplog):
    cfg = tmp_path / "meshnode.toml"
    cfg.write_text("batch_stages = true\n")
    with caplog.at_level("WARNING", logger="meshnode.config"):
        assert load_settings(cfg, env={}).lockstep is True
        assert load_settings(None, env={"MESHNODE_BATCH_STAGES": "false"}).lockstep is False
        # the new name wins where both are set
        assert load_settings(None, env={"MESHNODE_BATCH_STAGES": "false", "MESHNODE_LOCKSTEP": "true"}).lockstep
    said = [r.getMessage() for r in caplog.records]
    assert any("'batch_stages' is now called 'lockstep'" in m for m in said), said
    assert any("MESHNODE_BATCH_STAGES is now MESHNODE_LOCKSTEP" in m for m in said), said
    cfg.write_text("batch_stages = true\nlockstep = false\n")
    with pytest.raises(ConfigError, match="old name of 'lockstep': keep one"):
        load_settings(cfg, env={})
