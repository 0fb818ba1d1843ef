"""CPU per append of front doors to the same two members, beside one process direct (issue 26, item 2).

    python -m ops.frontdoor_compare [--seconds 4] [--rounds 2] [--clients 16] [--streams 64]
                                    [--no-paced-owners] [--only NAME ...]

One `streamkeep cluster run --processes 2` (memory storage; its own HAProxy, as generated, is the
first front door), one `streamkeep serve` direct, and beside them further front doors to the same
two members, each on its own port: HAProxy variants of the generated configuration, and nginx
(`ops/frontdoor_nginx.py`, when nginx is installed). Each round loads the direct process and then
every front door in turn (the order reversed every other round) with h2load over HTTP/1.1:
`--clients` connections, one 100 B append in flight each, cycling over `--streams` streams, as
fast as they are answered, as `ops/bench_cluster` does. CPU per append (user + sys from /proc) is
split into the front door's processes and the members' (with `cluster run` itself); idle front
doors cost the members only their health checks. Two passes have no front door: each member loaded
straight with the streams it owns (a client that knows the placement), as fast as answered and
paced at the rate the generated HAProxy carried in the same round (the members' part load without
the hop); the direct process is loaded again last. Prints one Markdown table with each front
door's total CPU per append over the direct process's (the mean of the round's first and last
direct pass; issue 26's target: <= 1.3x). nginx's configuration is for measuring only: the
Makefile does not install nginx (results: docs/benchmarks.md, issue 26).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from ops import frontdoor_nginx
from ops.bench_cluster import children, create_streams, haproxy_version, is_haproxy, progress
from ops.loadtest import h2load
from ops.serverproc import ServerProcess, launch, start
from streamkeep.cluster import haproxy
from streamkeep.cluster.placement import Member, Placement
from streamkeep.cluster.run import free_port, haproxy_binary, wait_until_listening
from streamkeep.protocol.names import STREAM_PREFIX

GENERATED = "HAProxy as generated (cluster run)"
DIRECT = "1 process, direct"
OWNERS = "no front door: each stream straight to its owner"
TARGET = 1.3


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU seconds the process has used so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


# HAProxy variants: each rewrites the generated configuration's text.
def _drop(*starts: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        return "\n".join(line for line in text.splitlines() if not line.strip().startswith(starts))

    return edit


def _add_to_defaults(*added: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        return text.replace("defaults\n", "defaults\n" + "".join(f"    {line}\n" for line in added), 1)

    return edit


def _chain(*edits: Callable[[str], str]) -> Callable[[str], str]:
    def edit(text: str) -> str:
        for one in edits:
            text = one(text)
        return text

    return edit


_REUSE = _add_to_defaults("http-reuse always")


def _no_rules(text: str) -> str:
    """Without the per-request rules beyond the slot lookup: the three headers, X-Forwarded-For, and
    the subscription and live-read rules (the members then see none of those headers: a floor, not a
    deployable configuration)."""
    kept = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("http-request set-header", "option forwardfor")):
            continue
        if stripped.startswith("use_backend") and ("field(" in stripped or "url_param(live)" in stripped):
            continue
        kept.append(line)
    return "\n".join(kept)


_NO_NODELAY = _drop("option http-no-delay")
_NO_CHECKS = _drop("option httpchk", "http-check expect")


def _untracked(text: str) -> str:
    """Servers without health checks (the live backends' `track` needs them; both lose them)."""
    out = []
    for line in _NO_CHECKS(text).splitlines():
        if line.strip().startswith("server "):
            words = line.split()
            line = "    " + " ".join(words[:3] + (words[3:5] if words[3:4] == ["maxconn"] else []))
        out.append(line)
    return "\n".join(out)


HAPROXY_VARIANTS: dict[str, Callable[[str], str]] = {
    "HAProxy + http-reuse always": _REUSE,
    "HAProxy, no header/ACL rules but the slot map": _no_rules,
    "HAProxy, no http-no-delay": _NO_NODELAY,
    "HAProxy bare (all three, no health checks)": _chain(_REUSE, _no_rules, _NO_NODELAY, _untracked),
}


@dataclass
class Door:
    name: str
    server: ServerProcess  # its url is the front door's; its process's tree is the front door's CPU
    own_tree: bool  # False: the front door is cluster run's HAProxy (the haproxy processes below it)
    owners: dict[str, list[str]] | None = None  # no front door: each member's URL and the paths it owns
    rate: float | None = None  # appends/s in all (None: as fast as answered)


@dataclass(frozen=True)
class Result:
    round: int
    name: str
    load: h2load.Load
    front_user_us: float
    front_sys_us: float
    members_us: float

    @property
    def front_us(self) -> float:
        return self.front_user_us + self.front_sys_us

    @property
    def total_us(self) -> float:
        return self.front_us + self.members_us


def start_haproxy(name: str, text: str, work: Path) -> Door:
    path = work / f"haproxy-{len(list(work.glob('haproxy-*.cfg')))}.cfg"
    path.write_text(text + "\n")
    binary = haproxy_binary()
    checked = subprocess.run([binary, "-c", "-q", "-f", str(path)], capture_output=True, text=True)
    if checked.returncode != 0:
        raise RuntimeError(f"haproxy refused {name} ({path}): {checked.stdout}{checked.stderr}")
    process = subprocess.Popen([binary, "-db", "-f", str(path)], stdout=subprocess.DEVNULL, text=True)
    return Door(name, ServerProcess(process, ""), own_tree=True)


def start_nginx(name: str, text: str, work: Path) -> Door:
    prefix = work / f"nginx-{len(list(work.glob('nginx-*')))}"
    prefix.mkdir()
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (prefix / sub).mkdir()
    path = prefix / "nginx.conf"
    path.write_text(text)
    checked = subprocess.run(
        ["nginx", "-t", "-q", "-c", str(path), "-p", str(prefix)], capture_output=True, text=True
    )
    if checked.returncode != 0:
        raise RuntimeError(f"nginx refused {name} ({path}): {checked.stdout}{checked.stderr}")
    process = subprocess.Popen(
        ["nginx", "-c", str(path), "-p", str(prefix)], stderr=subprocess.DEVNULL, text=True
    )
    return Door(name, ServerProcess(process, ""), own_tree=True)


def measure(
    door: Door, cluster: ServerProcess, paths: list[str], body: Path, args: argparse.Namespace, number: int
) -> Result:
    tree = children(cluster.process.pid)
    proxies = [pid for pid in tree if is_haproxy(pid)]
    members = [pid for pid in tree if pid not in proxies]
    if door.owners is not None:
        front = []
    else:
        front = children(door.server.process.pid) if door.own_tree else proxies
    before = {pid: cpu_split(pid) for pid in [*front, *members]}
    if door.owners is None:
        load = h2load.run(
            door.server, paths, clients=args.clients, body=body, content_type="text/plain", h2=False,
            seconds=args.seconds, latencies=True,
        )  # fmt: skip
    else:
        load = straight_to_owners(door.server, door.owners, body, args, door.rate)
    used = {pid: tuple(a - b for a, b in zip(cpu_split(pid), before[pid], strict=True)) for pid in before}
    if load.failed or not load.ok:
        raise RuntimeError(f"{door.name}: {load.failed} appends failed, {load.ok} answered")
    per = 1e6 / load.ok
    return Result(
        number,
        door.name,
        load,
        sum(used[pid][0] for pid in front) * per,
        sum(used[pid][1] for pid in front) * per,
        sum(sum(used[pid]) for pid in members) * per,
    )


def straight_to_owners(
    cluster: ServerProcess,
    owners: dict[str, list[str]],
    body: Path,
    args: argparse.Namespace,
    rate: float | None = None,
) -> h2load.Load:
    """The same load with no front door: one h2load per member at once, each with the member's share
    of the connections (and of `rate`) and only the streams it owns (a client that knows the
    placement)."""
    loads: list[h2load.Load] = []

    def one(url: str, owned: list[str]) -> None:
        member = ServerProcess(cluster.process, url)
        share = len(owned) / sum(len(some) for some in owners.values())
        clients = max(1, round(args.clients * share))
        loads.append(
            h2load.run(
                member,
                owned,
                clients=clients,
                body=body,
                content_type="text/plain",
                h2=False,
                seconds=args.seconds,
                latencies=True,
                rate=None if rate is None else rate * share,
            )
        )

    threads = [threading.Thread(target=one, args=item) for item in owners.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return h2load.Load(
        sum(load.ok for load in loads),
        sum(load.failed for load in loads),
        max(load.seconds for load in loads),
        0.0,
        [sample for load in loads for sample in load.latencies_us],
    )


def direct_pass(
    single: ServerProcess, paths: list[str], body: Path, args: argparse.Namespace, number: int
) -> Result:
    door = Door(DIRECT, single, own_tree=True)
    before = cpu_split(single.process.pid)
    load = h2load.run(
        single, paths, clients=args.clients, body=body, content_type="text/plain", h2=False,
        seconds=args.seconds, latencies=True,
    )  # fmt: skip
    user, system = (a - b for a, b in zip(cpu_split(single.process.pid), before, strict=True))
    if load.failed or not load.ok:
        raise RuntimeError(f"{door.name}: {load.failed} appends failed")
    return Result(number, door.name, load, 0.0, 0.0, (user + system) * 1e6 / load.ok)


def front_doors(
    args: argparse.Namespace, cluster: ServerProcess, data_dir: Path, work: Path, paths: list[str]
) -> list[Door]:
    table = tomllib.loads((data_dir / "cluster.toml").read_text())["cluster"]
    placement = Placement.of([Member(m["id"], m["address"]) for m in table["members"]], int(table["epoch"]))
    map_path = str((data_dir / "haproxy" / "slots.map").resolve())
    owners: dict[str, list[str]] = {}
    for path in paths:
        owners.setdefault(f"http://{placement.owner(path.removeprefix(STREAM_PREFIX)).address}", []).append(
            path
        )
    doors = []
    if not args.only or OWNERS in args.only:
        doors.append(Door(OWNERS, ServerProcess(cluster.process, cluster.url), own_tree=True, owners=owners))
    for name, edit in HAPROXY_VARIANTS.items():
        if args.only and name not in args.only:
            continue
        port = free_port("127.0.0.1")
        door = start_haproxy(name, edit(haproxy.config(placement, map_path=map_path, port=port)), work)
        door.server.url = f"http://127.0.0.1:{port}"
        doors.append(door)
    if shutil.which("nginx"):
        lua = frontdoor_nginx.MODULES / "ngx_http_lua_module.so"
        nginxes = {"nginx, Lua slot lookup": None, "nginx, static map of the bench's paths": paths}
        for name, static in nginxes.items():
            if (args.only and name not in args.only) or (static is None and not lua.exists()):
                continue
            port = free_port("127.0.0.1")
            prefix = work / f"nginx-{len(list(work.glob('nginx-*')))}"
            text = frontdoor_nginx.config(placement, prefix=prefix, port=port, static_paths=static)
            door = start_nginx(name, text, work)
            door.server.url = f"http://127.0.0.1:{port}"
            doors.append(door)
    else:
        progress(
            "nginx is not installed: HAProxy variants only (apt-get install nginx-light libnginx-mod-http-lua)"
        )
    for door in doors:
        host, listening = door.server.url.rsplit("/", 1)[1].rsplit(":", 1)
        wait_until_listening(host, int(listening), door.server.process)
    return doors


def routed_right(door: Door, paths: list[str]) -> None:
    """Every bench stream answers through this front door (a wrong member would answer 421)."""
    import httpx

    with httpx.Client(timeout=10) as client:
        for path in paths:
            answer = client.head(door.server.url + path)
            if answer.status_code != 200:
                raise RuntimeError(f"{door.name}: HEAD {path} answered {answer.status_code}: {answer.text}")


def report(results: list[Result], args: argparse.Namespace, loads: list[str]) -> None:
    print(
        f"\ndate: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; machine: {platform.node()}, {os.cpu_count()} cores; "
        f"load averages at each round's start: {'; '.join(loads)}; CPython {platform.python_version()}; "
        f"{haproxy_version()}; {nginx_version()}; memory storage, {args.clients} HTTP/1.1 connections over "
        f"{args.streams} streams, 100 B appends, {args.seconds:g} s a pass; command: python -m "
        "ops.frontdoor_compare " + " ".join(sys.argv[1:]) + "\n"
    )
    print(
        "| round | front door | appends/s | CPU per append: total | front door (user + sys) | members "
        "| total / direct | p50 / p99 / max ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    # A round's direct CPU per append: the mean of its first and last pass (this machine drifts).
    directs: dict[int, list[float]] = {}
    for r in results:
        if r.name == DIRECT:
            directs.setdefault(r.round, []).append(r.total_us)
    for r in results:
        ratio = r.total_us / (sum(directs[r.round]) / len(directs[r.round]))
        load = r.load
        print(
            f"| {r.round} | {r.name} | {load.per_second:,.0f} | {r.total_us:,.0f} µs "
            f"| {r.front_us:,.0f} ({r.front_user_us:,.0f} + {r.front_sys_us:,.0f}) µs | {r.members_us:,.0f} µs "
            f"| {ratio:.2f}x | {load.percentile_ms(0.5):.1f} / {load.percentile_ms(0.99):.1f} / "
            f"{max(load.latencies_us, default=0) / 1e3:.1f} |"
        )
    print(f"\ntarget: total / direct <= {TARGET}x (issue 26)")


def nginx_version() -> str:
    if not shutil.which("nginx"):
        return "nginx missing"
    done = subprocess.run(["nginx", "-v"], capture_output=True, text=True, timeout=10)
    return (done.stderr or done.stdout).strip().replace("nginx version: ", "")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="per pass (default 4)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument(
        "--no-paced-owners",
        dest="paced_owners",
        action="store_false",
        help="skip the pass straight to the owners paced at the generated front door's rate",
    )
    parser.add_argument("--only", nargs="*", default=[], help="front doors by name (default: all)")
    args = parser.parse_args()
    if not h2load.available():
        print("h2load is missing: apt-get install nghttp2-client (make bench does)", file=sys.stderr)
        return 2
    storage = ["--storage", "memory", "--log-level", "warning"]
    results: list[Result] = []
    loads: list[str] = []
    with tempfile.TemporaryDirectory(prefix="frontdoor-") as tmp:
        work = Path(tmp)
        body = work / "body"
        body.write_bytes(b"x" * 100)
        data_dir = work / "cluster"
        command = [sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", "2", "--port", "0"]
        cluster = launch([*command, "--data-dir", str(data_dir), *storage], timeout=60)
        single = start(*storage, "--data-dir", str(work / "single"))
        doors: list[Door] = []
        try:
            paths = create_streams(cluster, args.streams)
            direct_paths = create_streams(single, args.streams)
            doors = [
                Door(GENERATED, cluster, own_tree=False),
                *front_doors(args, cluster, data_dir, work, paths),
            ]
            for door in doors:
                routed_right(door, paths)
            time.sleep(1)
            for number in range(1, args.rounds + 1):
                loads.append(" ".join(f"{x:.2f}" for x in os.getloadavg()))
                progress(f"round {number}: load {loads[-1]}")
                results.append(direct_pass(single, direct_paths, body, args, number))
                for door in doors if number % 2 else list(reversed(doors)):
                    progress(f"round {number}: {door.name} ...")
                    results.append(measure(door, cluster, paths, body, args, number))
                # What the members pay for the hop alone: no front door, at the rate the generated one
                # carried this round (part load without the proxy).
                owners = next((door for door in doors if door.owners is not None), None)
                if owners is not None and args.paced_owners:
                    carried = next(r for r in reversed(results) if r.name == GENERATED).load.per_second
                    paced = replace(
                        owners, name=f"{OWNERS}, paced at the generated HAProxy's rate", rate=carried
                    )
                    progress(f"round {number}: {paced.name} ({carried:,.0f}/s) ...")
                    results.append(measure(paced, cluster, paths, body, args, number))
                results.append(direct_pass(single, direct_paths, body, args, number))
        finally:
            for door in doors:
                if door.server is not cluster and door.owners is None:
                    door.server.stop()
            single.stop()
            cluster.stop()
    report(results, args, loads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
