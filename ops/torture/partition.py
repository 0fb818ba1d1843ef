"""Network partitions of one "machine" of a replicated cluster on loopback, with iptables.

`streamkeep cluster run --replicas 2` gives each machine a loopback address of its own
(127.X.Y.<k+1>): its replicas listen on it and connect from it. Cutting every packet to or from
that address cuts the machine off from etcd, HAProxy and the other replicas. This machine is
shared (other runs may use the same addresses for their own clusters), so a rule drops only packets
between the machine's address and one of *this run's* ports (etcd's client ports, every replica's
HTTP and replication ports, HAProxy's): other clusters on the same addresses are left alone.

Every rule carries the comment `streamkeep-torture pid=<our pid>`, so `clear_stale` can remove the
rules a run that died left behind (those of live processes stay: two runs may overlap), and
`Partitions.heal_all` removes ours in a `finally`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading

TAG = "streamkeep-torture"
CHUNK = 15  # the most ports one `-m multiport` match takes
_OWNER = re.compile(rf'--comment "?{TAG} pid=(\d+)"?')


def iptables() -> str | None:
    return shutil.which("iptables") or next(
        (p for p in ("/usr/sbin/iptables", "/sbin/iptables") if os.access(p, os.X_OK)), None
    )


def _run(binary: str, *args: str) -> subprocess.CompletedProcess[str]:
    # -w: wait for the xtables lock (other runs may be changing rules too)
    return subprocess.run([binary, "-w", *args], capture_output=True, text=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_stale(binary: str) -> int:
    """Removes the rules of torture runs whose process is gone; returns how many."""
    listed = _run(binary, "-S", "INPUT")
    removed = 0
    for line in listed.stdout.splitlines():
        found = _OWNER.search(line)
        if not line.startswith("-A INPUT ") or found is None or _alive(int(found.group(1))):
            continue
        spec = line.removeprefix("-A INPUT ").replace('"', "").split()
        removed += _run(binary, "-D", "INPUT", *spec).returncode == 0
    return removed


def rules(address: str, ports: list[int]) -> list[list[str]]:
    """The rule specs that cut `address` off from `ports` (both directions, both ends)."""
    comment = ["-m", "comment", "--comment", f"{TAG} pid={os.getpid()}"]
    specs = []
    ordered = sorted(set(ports))
    for at in range(0, len(ordered), CHUNK):
        listed = ",".join(map(str, ordered[at : at + CHUNK]))
        for side, port_side in (
            ("-s", "--dports"),
            ("-s", "--sports"),
            ("-d", "--dports"),
            ("-d", "--sports"),
        ):
            specs.append(
                [side, address, "-p", "tcp", "-m", "multiport", port_side, listed, *comment, "-j", "DROP"]
            )
    return specs


class Partitions:
    """The cuts this run has in place, by machine address."""

    def __init__(self, binary: str, ports: list[int]) -> None:
        self.binary = binary
        self.ports = ports
        self.active: dict[str, list[list[str]]] = {}
        self.lock = threading.Lock()

    def cut(self, address: str, ports: list[int] | None = None) -> None:
        """Cuts `address` off from this run's ports (or only from `ports`)."""
        with self.lock:
            if address in self.active:
                return
            added: list[list[str]] = []
            self.active[address] = added
            for spec in rules(address, self.ports if ports is None else ports):
                done = _run(self.binary, "-I", "INPUT", *spec)
                if done.returncode != 0:
                    raise RuntimeError(f"iptables -I INPUT {' '.join(spec)}: {done.stderr.strip()}")
                added.append(spec)

    def heal(self, address: str) -> None:
        with self.lock:
            for spec in self.active.pop(address, []):
                _run(self.binary, "-D", "INPUT", *spec)

    def heal_all(self) -> None:
        for address in list(self.active):
            self.heal(address)
