"""ops/frontdoor_compare.py's HAProxy variants: each rewrites the generated configuration into one
HAProxy accepts, and does change it (a variant whose edit stopped matching after a change to
streamkeep/cluster/haproxy.py would silently measure the generated configuration again)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ops.frontdoor_compare import HAPROXY_VARIANTS
from streamkeep.cluster import haproxy
from streamkeep.cluster.placement import Member, Placement
from tests.test_cluster import HAPROXY


def test_each_haproxy_variant_changes_the_generated_configuration_into_a_valid_one(tmp_path: Path) -> None:
    assert Path(HAPROXY).exists(), (
        "haproxy is missing: make system-tools installs it (apt-get install haproxy)"
    )
    placement = Placement.of([Member("m0", "127.0.0.1:7100"), Member("m1", "127.0.0.1:7101")], 1)
    generated = haproxy.write(placement, tmp_path, port=7199).read_text()
    map_path = str((tmp_path / "slots.map").resolve())
    assert generated == haproxy.config(placement, map_path=map_path, port=7199)
    for number, (name, edit) in enumerate(HAPROXY_VARIANTS.items()):
        text = edit(generated)
        assert text != generated, name
        path = tmp_path / f"variant-{number}.cfg"
        path.write_text(text + "\n")
        checked = subprocess.run([HAPROXY, "-c", "-q", "-f", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, f"{name}: {checked.stdout}{checked.stderr}"
    bare = HAPROXY_VARIANTS["HAProxy bare (all three, no health checks)"](generated)
    routes = [line.strip() for line in bare.splitlines() if line.strip().startswith("use_backend")]
    assert routes == [f"use_backend %[path,crc32,mod(4096),map({map_path})] if {{ path_beg /v1/stream/ }}"]
    assert "http-reuse always" in bare and "http-no-delay" not in bare
    assert not any(word in bare for word in ("set-header", "forwardfor", " check", " track "))
