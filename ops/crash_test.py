"""Crash test: appenders run against a disk-backed server that is killed with SIGKILL at random.

    python -m ops.crash_test --kills 20

Half the writers are idempotent producers, half plain appenders, each on its own stream, plus
all of them on one shared stream. After every restart the checker reads each stream and demands:
every acknowledged append present exactly once and in order, nothing unacknowledged twice; and each
producer retries its in-flight append with the same (epoch, seq), which must then be stored exactly
once (204 if it had survived the crash, 200 if not).
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import httpx

from ops.client import read_all
from ops.serverproc import start

CT = {"Content-Type": "text/plain"}


@dataclass
class Writer:
    number: int
    producer: bool
    seq: int = 0  # next payload number (and Producer-Seq)
    acked: list[int] = field(default_factory=list)
    in_flight: int | None = None

    @property
    def stream(self) -> str:
        return f"/v1/stream/crash-{self.number}"

    def payload(self, n: int) -> bytes:
        return f"w{self.number}:{n};".encode()

    def headers(self, n: int) -> dict[str, str]:
        if not self.producer:
            return CT
        return {**CT, "Producer-Id": f"writer-{self.number}", "Producer-Epoch": "0", "Producer-Seq": str(n)}


def parse(body: bytes) -> list[tuple[int, int]]:
    out = []
    for part in body.decode().split(";"):
        if part:
            writer, n = part[1:].split(":")
            out.append((int(writer), int(n)))
    return out


def write_until_stopped(
    base: str, writer: Writer, shared_acked: list[tuple[int, int]], stop: threading.Event
) -> None:
    with httpx.Client(base_url=base, timeout=5) as client:
        while not stop.is_set():
            n = writer.seq
            writer.in_flight = n
            try:
                response = client.post(writer.stream, content=writer.payload(n), headers=writer.headers(n))
            except httpx.HTTPError:
                return  # the server died mid-request: the append is in flight
            if response.status_code not in (200, 204):
                raise AssertionError(f"{writer.stream}: append {n} answered {response.status_code}")
            writer.acked.append(n)
            writer.in_flight = None
            writer.seq += 1
            try:  # the shared stream: plain appends from everyone
                shared = client.post("/v1/stream/crash-shared", content=writer.payload(n), headers=CT)
                if shared.status_code == 204:
                    shared_acked.append((writer.number, n))
            except httpx.HTTPError:
                return


def check_stream(client: httpx.Client, writer: Writer) -> None:
    stored = [n for _, n in parse(read_all(client, writer.stream))]
    if len(stored) != len(set(stored)):
        raise AssertionError(f"{writer.stream}: duplicates stored: {stored}")
    if stored != sorted(stored):
        raise AssertionError(f"{writer.stream}: out of order: {stored}")
    missing = set(writer.acked) - set(stored)
    if missing:
        raise AssertionError(f"{writer.stream}: acknowledged appends lost: {sorted(missing)}")


def run(kills: int, writers: int, seed: int, log=print) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    team = [Writer(i, producer=i % 2 == 0) for i in range(writers)]
    shared_acked: list[tuple[int, int]] = []
    with tempfile.TemporaryDirectory() as data_dir:
        args = ("--storage", "disk", "--data-dir", data_dir, "--fsync", "always")
        server = start(*args)
        with httpx.Client(base_url=server.url, timeout=5) as client:
            for writer in team:
                client.put(writer.stream, headers=CT).raise_for_status()
            client.put("/v1/stream/crash-shared", headers=CT).raise_for_status()
        for round_number in range(1, kills + 1):
            stop = threading.Event()
            threads = [
                threading.Thread(target=write_until_stopped, args=(server.url, w, shared_acked, stop))
                for w in team
            ]
            for thread in threads:
                thread.start()
            time.sleep(rng.uniform(0.2, 0.8))
            server.process.send_signal(signal.SIGKILL)
            server.process.wait()
            stop.set()
            for thread in threads:
                thread.join()
            server = start(*args)
            with httpx.Client(base_url=server.url, timeout=10) as client:
                retried = 0
                for writer in team:
                    if writer.producer and writer.in_flight is not None:
                        n = writer.in_flight
                        response = client.post(
                            writer.stream, content=writer.payload(n), headers=writer.headers(n)
                        )
                        if response.status_code not in (200, 204):
                            raise AssertionError(
                                f"{writer.stream}: retry of {n} answered {response.status_code}"
                            )
                        writer.acked.append(n)
                        writer.in_flight = None
                        writer.seq += 1
                        retried += 1
                    elif writer.in_flight is not None:
                        writer.seq += 1  # plain appends are not retried: at most once
                        writer.in_flight = None
                for writer in team:
                    check_stream(client, writer)
                stored_shared = parse(read_all(client, "/v1/stream/crash-shared"))
                if len(stored_shared) != len(set(stored_shared)):
                    raise AssertionError("shared stream: duplicates stored")
                lost = set(shared_acked) - set(stored_shared)
                if lost:
                    raise AssertionError(f"shared stream: acknowledged appends lost: {sorted(lost)[:10]}")
            total = sum(len(w.acked) for w in team)
            log(
                f"kill {round_number}/{kills}: {total} acknowledged appends on own streams, "
                f"{len(shared_acked)} on the shared one, {retried} producer retries: "
                "all present once, in order"
            )
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    args = parser.parse_args()
    print(f"crash test: seed {args.seed}, {args.kills} kills, {args.writers} writers")
    try:
        run(args.kills, args.writers, args.seed)
    except AssertionError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
