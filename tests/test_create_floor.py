"""ops/create_floor.py, run tiny on a real file system: the server's own create steps, measured."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from ops import create_floor
from streamkeep.storage.files import OsFileSystem
from tests.ops_script import run_with_json


def test_the_floor_reports_each_method_with_real_figures(tmp_path: Path) -> None:
    stdout, floors = run_with_json(
        "ops.create_floor",
        "--dir",
        str(tmp_path),
        "--creates",
        "40",
        "--round",
        "8",
        out=tmp_path / "floor.json",
    )
    assert [floor["method"] for floor in floors] == ["fdatasync", "syncfs", "one file"]
    for floor in floors:
        assert floor["creates"] == 40
        assert math.isfinite(floor["per_second"]) and floor["per_second"] > 0
        assert floor["user_us"] >= 0 and floor["sys_us"] >= 0
    assert "| fdatasync |" in stdout
    assert os.listdir(tmp_path) == ["floor.json"], "its work directory was left behind"


@pytest.mark.parametrize("syncfs", [False, True])
def test_a_round_makes_streams_as_the_server_does(tmp_path: Path, syncfs: bool) -> None:
    """The steps measured are the create round's: each stream in place, with its two files."""
    streams = tmp_path / "streams"
    streams.mkdir()
    create_floor.server_steps(OsFileSystem(), streams, 3, syncfs)(7)
    made = sorted(os.listdir(streams))
    assert made == ["r7-s0", "r7-s1", "r7-s2"], "a staging directory was left, or a stream missing"
    assert (streams / "r7-s1" / "meta.cbor").read_bytes() == create_floor.META
    assert (streams / "r7-s1" / "0000000000000000.seg").read_bytes() == create_floor.SEGMENT
