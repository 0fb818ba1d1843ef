"""Setting up replication: the errors that say what is missing, and the HAProxy configuration for
real machines (`cluster haproxy-config` from a `[cluster]` section that lists each member's two
replicas), checked by HAProxy itself."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from streamkeep import config
from streamkeep.cli import main
from streamkeep.cluster.run import haproxy_binary

CLUSTER = """
[cluster]
members = [{id = "m0", address = "10.0.0.9:7000"}, {id = "m1", address = "10.0.0.9:7001"}]
replicas = [{id = "m0a", address = "10.0.0.1:4437"}, {id = "m0b", address = "10.0.0.2:4438"},
            {id = "m1a", address = "10.0.0.2:4437"}, {id = "m1b", address = "10.0.0.1:4438"}]
"""
SECRET = "s" * 40


def test_haproxy_config_for_replicas_routes_each_member_to_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    toml = tmp_path / "cluster.toml"
    toml.write_text(CLUSTER)
    assert main(["cluster", "haproxy-config", "--config", str(toml), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "haproxy.cfg").read_text()
    backend = text.split("\nbackend member_m0", 1)[1].split("\n\n", 1)[0]
    assert "option redispatch 1" in backend
    assert "server m0a 10.0.0.1:4437 maxconn 32 check" in backend
    assert "server m0b 10.0.0.2:4438 maxconn 32 check" in backend
    # Live reads and the members' calls to each other: uncapped, on the same replicas' health.
    live = text.split("\nbackend member_m0_live", 1)[1].split("\n\n", 1)[0]
    assert "server m0a 10.0.0.1:4437 track member_m0/m0a" in live and "maxconn" not in live
    assert "frontend peer_m0\n    bind 10.0.0.9:7000\n    default_backend member_m0_live" in text
    assert "replicas m0a at 10.0.0.1:4437, m0b at 10.0.0.2:4438" in capsys.readouterr().out
    checked = subprocess.run(
        [haproxy_binary(), "-c", "-q", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        ('[{id = "m0a", address = "h:1"}, {id = "m0b", address = "h:2"}]', "members m1 need both replicas"),
        ('[{id = "m0c", address = "h:1"}]', "<member>a or <member>b"),
    ],
)
def test_a_replica_list_that_misses_one_is_refused(tmp_path: Path, replicas: str, message: str) -> None:
    toml = tmp_path / "cluster.toml"
    toml.write_text(CLUSTER.split("replicas =")[0] + f"replicas = {replicas}\n")
    with pytest.raises(config.ConfigError, match=message):
        config.load(str(toml))


def test_replicas_two_names_every_flag_it_lacks(tmp_path: Path) -> None:
    toml = tmp_path / "cluster.toml"
    toml.write_text(CLUSTER)
    with pytest.raises(config.ConfigError, match="--replica, --replication-listen, --etcd, --cluster-secret"):
        config.load(str(toml), env={}, cli={"cluster_member": "m0", "replication_replicas": 2})
    with pytest.raises(config.ConfigError, match="1 or 2"):
        config.load(str(toml), env={}, cli={"replication_replicas": 3})
    ready = {
        "cluster_member": "m0", "replication_replicas": 2, "replication_replica": "m1a",
        "replication_listen": "127.0.0.1:1", "replication_etcd": "http://127.0.0.1:2379", "cluster_secret": SECRET,
    }  # fmt: skip
    with pytest.raises(config.ConfigError, match="m0a or m0b"):
        config.load(str(toml), env={}, cli=ready)
    with pytest.raises(config.ConfigError, match=r"storage\.mode disk|--fsync always"):
        config.load(str(toml), env={}, cli={**ready, "replication_replica": "m0a", "storage_mode": "memory"})
    settings = config.load(str(toml), env={}, cli={**ready, "replication_replica": "m0b"})
    assert settings.replication.replicas == 2 and settings.cluster.replicas["m1"][1] == (
        "m1b",
        "10.0.0.1:4438",
    )
