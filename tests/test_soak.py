"""The soak tool (ops/soak.py): its verdict on made-up samples, and a short real run."""

from __future__ import annotations

from ops import soak


def samples(fds: list[int], rss: list[int], deleted: int = 0) -> list[soak.Sample]:
    return [
        soak.Sample(i * 10.0, f, deleted, r, 10, i * 100)
        for i, (f, r) in enumerate(zip(fds, rss, strict=True))
    ]


def test_the_verdict_tells_flat_from_growing() -> None:
    flat, why = soak.verdict(samples([80, 95, 90, 92, 88, 94, 91, 93, 90], [40_000] * 3 + [52_000] * 6))
    assert flat, why
    leaking, why = soak.verdict(samples([64, 70, 80, 95, 110, 125, 140, 155, 170], [40_000] * 9))
    assert not leaking and "descriptors grew" in why
    growing, why = soak.verdict(
        samples([80] * 9, [40_000, 42_000, 44_000, 46_000, 48_000, 50_000, 53_000, 56_000, 59_000])
    )
    assert not growing and "RSS grew" in why
    holding, why = soak.verdict(samples([80] * 9, [40_000] * 9, deleted=33))
    assert not holding and "deleted files" in why
    assert not soak.verdict(samples([80] * 3, [40_000] * 3))[0]


def test_a_short_soak_samples_and_reports() -> None:
    lines: list[str] = []
    _, taken, tally = soak.run(0.3, seed=5, cold=False, writers=4, readers=4, every=2.0, out=lines.append)
    assert len(taken) >= 6 and taken[-1].requests > 200
    assert any(line.startswith("| sample |") for line in lines) and any(
        line.startswith("verdict:") for line in lines
    )
    assert not {status for status in tally.statuses if status >= 500}, tally.statuses
    assert all(sample.deleted_fds <= 2 for sample in taken)


def test_a_restarted_process_is_a_new_series_and_a_restart() -> None:
    watch = soak.Watch(started=0.0)
    assert watch.label("m0a", 100) == "m0a"
    assert watch.label("m0a", 100) == "m0a"
    assert watch.label("m0b", 101) == "m0b"
    assert watch.label("m0a", 200) == "m0a#2"
    assert watch.label("m0a", 200) == "m0a#2"
    assert watch.label("m0a", 300) == "m0a#3"
    assert len(watch.restarts) == 2 and watch.restarts[0].startswith("m0a: pid 100 -> 200")
    assert watch.pids == {"m0a": 100, "m0b": 101, "m0a#2": 200, "m0a#3": 300}


def test_cluster_processes_are_named_by_replica_or_program() -> None:
    assert (
        soak.process_name(["python", "-m", "streamkeep", "serve", "--replica", "m1b", "--port", "1"]) == "m1b"
    )
    assert soak.process_name(["/usr/sbin/haproxy", "-db", "-f", "x.cfg"]) == "haproxy"
    assert soak.process_name(["/usr/bin/etcd", "--name", "etcd0"]) == "etcd"


def test_the_per_process_row_fails_a_grower_but_not_a_short_series() -> None:
    grows = samples([80] * 9, [40_000, 42_000, 44_000, 46_000, 48_000, 50_000, 53_000, 56_000, 59_000])
    row, flat = soak.process_row("m0a", 1, "owner", grows)
    assert not flat and "NOT FLAT" in row
    row, flat = soak.process_row("m0a#2", 2, "follower", grows[:3])
    assert flat and "too short" in row
    row, flat = soak.process_row("etcd", 3, "", samples([20] * 9, [30_000] * 9))
    assert flat and row.endswith("| flat |")


def test_tracemalloc_takes_a_depth_and_defaults_to_eight_frames() -> None:
    """`--tracemalloc` alone once passed True where ops/traced_serve.py wants a frame count, and
    the server exited at start."""
    from ops.soak import arguments

    assert arguments([])[1].tracemalloc == 0
    assert arguments(["--tracemalloc"])[1].tracemalloc == 8
    assert arguments(["--tracemalloc", "3"])[1].tracemalloc == 3
