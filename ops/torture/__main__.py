"""python -m ops.torture: seeded torture runs of streamkeep, judged against one model of the protocol.

    python -m ops.torture blackbox --seed 7 --duration 60 [--fsync always|interval|never]
        [--sync-method fdatasync|syncfs] [--disk tmpfs|ext4|plain] [--no-cold] [--workers 6]
        [--seeds K | --until-failure] [--matrix --total-minutes M] [--cluster 2] [--minutes M]
    python -m ops.torture blackbox --cluster 3 --replicas 2 --minutes 30   # replicated (issue 23)
    python -m ops.torture check HISTORY.jsonl    # judge a dumped history again
    python -m ops.torture sim --seed 7 [--seeds K] [--ops N] [--fsync ...] [--matrix --total-minutes M]
    python -m ops.torture all --total-minutes 30 [--cluster 2]  # both tiers: what `make torture` runs
    python -m ops.torture sync --seed 7 --minutes 3   # `streamkeep sync` with Postgres (issue 25)

Exit status 1 on any finding. `--matrix` cycles through fsync modes and disks (and the cold tier on
and off) with increasing seeds until `--total-minutes` have passed: what `make torture` runs.
`--cluster N` runs N members behind HAProxy instead of one server (ops/torture/cluster.py); with
`--replicas 2` each member is on two replicas coordinated by a 3-member etcd, under kill -9, disk
loss, SIGSTOP, partitions and etcd member loss (ops/torture/replicated.py).
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import tempfile
import time
from pathlib import Path

from ops.torture import cluster as cluster_tier
from ops.torture import replicated as replicated_tier
from ops.torture import sim as sim_tier
from ops.torture import simthreads
from ops.torture import syncbridge as sync_tier
from ops.torture.blackbox import Options, format_summary, run
from ops.torture.checker import check_history
from ops.torture.history import History
from ops.torture.model import RunConfig

MATRIX = [
    ("always", "fdatasync", "tmpfs", True),
    ("interval", "fdatasync", "ext4", True),
    ("never", "syncfs", "tmpfs", False),
    ("always", "syncfs", "ext4", False),
    ("interval", "fdatasync", "plain", True),
    ("always", "fdatasync", "ext4", True),
]


def blackbox(args: argparse.Namespace) -> int:
    if args.cluster == 1:
        raise SystemExit("--cluster: a cluster run needs at least 2 members (0: one server)")
    if args.replicas not in (0, 2) or (args.replicas and args.cluster < 2):
        raise SystemExit("--replicas: 2, with --cluster N (N >= 2; 3 for the issue's runs)")
    base = Options(
        seed=args.seed,
        duration=args.duration if args.minutes is None else args.minutes * 60,
        fsync=args.fsync,
        sync_method=args.sync_method,
        disk=args.disk,
        cold=not args.no_cold,
        retention=not args.no_retention,
        workers=args.workers,
        dump_dir=Path(args.dump_dir),
        server_args=tuple(args.server_args.split()),
        cluster=args.cluster,
        replicas=args.replicas,
        replica_faults=tuple(k for k in args.replica_faults.split(",") if k),
    )
    failed: list[str] = []
    began = time.monotonic()
    for index in itertools.count():
        options = Options(**{**base.__dict__, "seed": base.seed + index})
        if args.matrix:
            options.fsync, options.sync_method, options.disk, options.cold = MATRIX[index % len(MATRIX)]
        print(f"== {options.replay()}", flush=True)
        tier = replicated_tier.run if options.replicas else cluster_tier.run if options.cluster else run
        result = tier(options, log=lambda line: print(line, flush=True))
        print(format_summary(result), flush=True)
        if result.summary.findings:
            failed.append(options.replay())
            if args.until_failure:
                break
        if args.matrix:
            if time.monotonic() - began + options.duration + 20 > args.total_minutes * 60:
                break
        elif not args.until_failure and index + 1 >= args.seeds:
            break
    if failed:
        print("\nfailing runs:\n" + "\n".join(f"  {command}" for command in failed))
        return 1
    return 0


def sync_bridge(args: argparse.Namespace) -> int:
    failed = []
    for index in range(args.seeds):
        options = sync_tier.Options(
            seed=args.seed + index, duration=args.duration if args.minutes is None else args.minutes * 60
        )
        print(f"== {options.replay()}", flush=True)
        result = sync_tier.run(options, log=lambda line: print(line, flush=True))
        print("counts: " + ", ".join(f"{k} {n}" for k, n in sorted(result.counts.items())), flush=True)
        for finding in result.findings:
            print(f"  - {finding}", flush=True)
        print(f"findings: {len(result.findings)}", flush=True)
        if result.findings:
            failed.append(options.replay())
    if failed:
        print("\nfailing runs:\n" + "\n".join(f"  {command}" for command in failed))
        return 1
    return 0


def check(args: argparse.Namespace) -> int:
    meta, events = History.load(Path(args.history))
    config = RunConfig(
        fsync=meta.get("fsync", "always"),
        fsync_interval=float(meta.get("fsync_interval", 1.0)),
        cold=meta.get("cold", "True") == "True",
        retention=meta.get("retention", "False") == "True",
        members=tuple(m for m in meta.get("members", "").split(",") if m),
    )
    summary = check_history(events, config)
    print(
        f"{len(events)} events; checks: " + ", ".join(f"{k} {n}" for k, n in sorted(summary.checks.items()))
    )
    for finding in summary.findings:
        print(f"  - {finding}")
    print(f"findings: {len(summary.findings)}")
    return 1 if summary.findings else 0


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # so every run's teardown (unmounts) still happens


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(prog="python -m ops.torture", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    box = commands.add_parser("blackbox", help="a real server process under seeded operations and faults")
    box.add_argument("--seed", type=int, default=1)
    box.add_argument("--duration", type=float, default=60.0, help="seconds of workload per run")
    box.add_argument(
        "--minutes", type=float, default=None, help="minutes of workload per run (sets --duration)"
    )
    box.add_argument("--fsync", choices=("always", "interval", "never"), default="always")
    box.add_argument("--sync-method", choices=("fdatasync", "syncfs"), default="fdatasync")
    box.add_argument("--disk", choices=("tmpfs", "ext4", "plain"), default="tmpfs")
    box.add_argument("--no-cold", action="store_true", help="no S3 cold tier")
    box.add_argument("--no-retention", action="store_true", help="no retention rules, no compaction")
    box.add_argument("--workers", type=int, default=6)
    box.add_argument("--seeds", type=int, default=1, help="runs, with seeds seed, seed+1, ...")
    box.add_argument("--until-failure", action="store_true", help="next seed until a run finds something")
    box.add_argument("--matrix", action="store_true", help="cycle fsync modes, disks and cold tier")
    box.add_argument("--total-minutes", type=float, default=30.0, help="with --matrix: stop after this long")
    box.add_argument(
        "--dump-dir",
        default=str(Path(tempfile.gettempdir()) / "torture-runs"),
        help="where failing runs leave their history, server output and bricked data directories",
    )
    box.add_argument("--server-args", default="", help="extra `streamkeep serve` flags (they win)")
    box.add_argument(
        "--cluster",
        type=int,
        default=0,
        metavar="N",
        help="N members behind HAProxy, one killed at a time, forks across members (ops/torture/cluster.py)",
    )
    box.add_argument(
        "--replicas",
        type=int,
        default=0,
        choices=(0, 2),
        help="with --cluster N: each member on two replicas with etcd, under kill -9, disk loss, "
        "SIGSTOP, partitions and etcd member loss (ops/torture/replicated.py)",
    )
    box.add_argument(
        "--replica-faults",
        default="",
        metavar="KINDS",
        help="with --replicas 2: the fault kinds to use, comma-separated (default: all of "
        + ", ".join(replicated_tier.KINDS)
        + ")",
    )
    box.set_defaults(run=blackbox)
    bridge = commands.add_parser(
        "sync", help="`streamkeep sync` between real Postgres and streamkeep under seeded faults"
    )
    bridge.add_argument("--seed", type=int, default=1)
    bridge.add_argument("--duration", type=float, default=120.0, help="seconds of workload per run")
    bridge.add_argument("--minutes", type=float, default=None, help="minutes of workload (sets --duration)")
    bridge.add_argument("--seeds", type=int, default=1, help="runs, with seeds seed, seed+1, ...")
    bridge.set_defaults(run=sync_bridge)
    checking = commands.add_parser("check", help="judge a dumped history again")
    checking.add_argument("history")
    checking.set_defaults(run=check)
    sim = commands.add_parser("sim", help="the deterministic in-process tier (SimFS, mock clock)")
    sim_tier.add_arguments(sim)
    sim.add_argument("--matrix", action="store_true", help="cycle fsync modes and sync methods")
    sim.add_argument("--total-minutes", type=float, default=0.0, help="with --matrix: stop after this long")
    sim.set_defaults(run=simulate)
    both = commands.add_parser(
        "all", help="both tiers for --total-minutes: a third in-process, the rest black box"
    )
    both.add_argument("--total-minutes", type=float, default=30.0)
    both.add_argument("--seed", type=int, default=1)
    both.add_argument(
        "--cluster",
        type=int,
        default=0,
        metavar="N",
        help="give half of the black box's time to runs of N members behind HAProxy (blackbox --cluster)",
    )
    both.set_defaults(run=all_tiers)
    args = parser.parse_args()
    if args.command in ("sim", "all"):
        simthreads.reexec_with_hash_seed()  # sets of str iterate by hash: one seed, one run
    return int(args.run(args))


SIM_MATRIX = [
    ("always", "fdatasync"),
    ("interval", "fdatasync"),
    ("always", "syncfs"),
    ("never", "fdatasync"),
    ("interval", "syncfs"),
]


def simulate(args: argparse.Namespace) -> int:
    """The in-process tier: --seeds runs, or with --matrix seeds across the fsync modes until
    --total-minutes have passed. Prints a summary; exit 1 on any finding."""
    if not args.matrix:
        return sim_tier.main(args)
    began, runs, ops, failed = time.monotonic(), 0, 0, []
    faults: dict[str, int] = {}
    for index in itertools.count():
        if time.monotonic() - began >= args.total_minutes * 60:
            break
        args.fsync, args.sync_method = SIM_MATRIX[index % len(SIM_MATRIX)]
        result = sim_tier.run(sim_tier.config_from(args, args.seed + index))
        runs += 1
        ops += sum(result.summary.op_kinds().values())
        for kind, count in result.faults.items():
            faults[kind] = faults.get(kind, 0) + count
        if not result.ok:
            failed.append(sim_tier.report(result))
            print(failed[-1], flush=True)
        if runs % 20 == 0:
            print(
                f"[sim {time.monotonic() - began:6.0f}s] {runs} seeds, {ops} operations, {len(failed)} failing",
                flush=True,
            )
    print(
        f"in-process tier: {runs} seeds from {args.seed}, {ops} operations, faults "
        f"{dict(sorted(faults.items()))}: {len(failed)} failing" + ("" if failed else " (all clean)"),
        flush=True,
    )
    return 1 if failed else 0


def all_tiers(args: argparse.Namespace) -> int:
    """What `make torture` runs: the in-process tier for a third of the time, the black box for
    the rest, each printing its summary (with --cluster N, half of the black box's time goes to
    N-member runs, across the same matrix)."""
    parser = argparse.ArgumentParser()
    sim_tier.add_arguments(parser)
    sim_args = parser.parse_args(["--seed", str(args.seed), "--ops", "4000"])
    sim_args.matrix, sim_args.total_minutes = True, args.total_minutes / 3
    status = simulate(sim_args)
    box = argparse.Namespace(
        seed=args.seed,
        duration=120.0,
        fsync="always",
        sync_method="fdatasync",
        disk="tmpfs",
        no_cold=False,
        no_retention=False,
        workers=6,
        seeds=1,
        until_failure=False,
        matrix=True,
        total_minutes=args.total_minutes * 2 / 3,
        dump_dir=str(Path(tempfile.gettempdir()) / "torture-runs"),
        server_args="",
        cluster=0,
        replicas=0,
        minutes=None,
        replica_faults="",
    )
    if not args.cluster:
        return max(status, blackbox(box))
    box.total_minutes /= 2
    status = max(status, blackbox(box))
    cluster = argparse.Namespace(**{**vars(box), "cluster": args.cluster, "duration": 60.0})
    return max(status, blackbox(cluster))


if __name__ == "__main__":
    sys.exit(main())
