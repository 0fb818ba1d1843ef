"""Run upstream's client conformance suite (packages/client-conformance-tests) against a client.

    python -m ops.client_conformance --upstream DIR                  # our adapter (streamkeep.client)
    python -m ops.client_conformance --upstream DIR --adapter ts     # upstream's TypeScript client
    python -m ops.client_conformance --upstream DIR --adapter upstream-py  # upstream's client-py
    python -m ops.client_conformance --upstream DIR -- --suite producer --verbose   # runner flags

DIR is a checkout or an extract of the durable-streams/durable-streams repository at the pinned
commit, for instance from the bare snapshot this project keeps:

    mkdir -p /tmp/ds-upstream
    git -C /work/.mirror/durable-streams+durable-streams/repo archive 82f9963ae0b489566352393be9b4796c788c99c2 \\
        packages/client-conformance-tests packages/client-py | tar -x -C /tmp/ds-upstream

(those two packages: the suite and upstream's Python client, whose adapter can be run too; an
archive of the whole tree fails, the snapshot lacks one binary's blob).
The suite's files are checked against that commit's (their git tree hash, so an extract without
.git is checked as well as a checkout) and a different suite is refused unless --allow-other-commit.
The runner is Node: its npm dependencies (the reference server and client at the versions the
pinned commit carries) are installed in ops/client_conformance/node_modules from package-lock.json
(`make client-conformance` does that first). The suite's src/ and test-cases/ are copied beside
them into ops/client_conformance/suite/ (git-ignored) so Node resolves those dependencies.

The runner always starts its own reference server (@durable-streams/server's DurableStreamTestServer,
in process) and injects faults through that server's /_test/inject-error endpoint: it has no
option to target another server. --server streamkeep starts `streamkeep serve` (memory storage) and
swaps that class, through a Node module hook (server-hook.mjs), for a small fault-injecting proxy
in front of it (streamkeep_server.mjs) that serves /_test/inject-error as the reference server
does, so the same cases run against streamkeep.
Exits with the runner's status: 0 when no case failed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PINNED_COMMIT = "82f9963ae0b489566352393be9b4796c788c99c2"
# `git rev-parse <PINNED_COMMIT>:packages/client-conformance-tests` and `...:packages/client-py`
PINNED_SUITE_TREE = "455bc8dd732f75db6aaaf44403cc21ba3e01f34a"
PINNED_CLIENT_PY_TREE = "e8679fb6f6680e3dd91958feee75227b1f65c222"
SUITE = "packages/client-conformance-tests"
CLIENT_PY = "packages/client-py"
WORK = HERE / "suite"
MIRROR = "/work/.mirror/durable-streams+durable-streams/repo"


def git_tree_hash(directory: Path) -> str:
    """The id git gives this directory's tree (regular files, executables, symlinks, subtrees)."""
    entries: list[tuple[str, bytes, bytes]] = []
    for entry in os.scandir(directory):
        path = Path(entry.path)
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            blob = os.readlink(path).encode()
            entries.append((entry.name, b"120000", git_object("blob", blob)))
        elif stat.S_ISDIR(mode):
            if not any(True for _ in os.scandir(path)):
                continue  # git keeps no empty directory
            entries.append((entry.name + "/", b"40000", bytes.fromhex(git_tree_hash(path))))
        else:
            kind = b"100755" if mode & stat.S_IXUSR else b"100644"
            entries.append((entry.name, kind, git_object("blob", path.read_bytes())))
    entries.sort(key=lambda item: item[0].encode())  # git sorts a subtree as if named "name/"
    body = b"".join(
        kind + b" " + name.rstrip("/").encode() + b"\0" + digest for name, kind, digest in entries
    )
    return git_object("tree", body).hex()


def git_object(kind: str, body: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).digest()


def check_upstream(upstream: Path, allow_other: bool) -> None:
    suite = upstream / SUITE
    if not (suite / "src" / "cli.ts").is_file():
        sys.exit(f"{suite}/src/cli.ts is not there: --upstream must be the repository's root")
    found = git_tree_hash(suite)
    if found == PINNED_SUITE_TREE:
        print(f"upstream suite: {SUITE} as at {PINNED_COMMIT} (tree {found})")
        return
    message = (
        f"{SUITE} in {upstream} is not the one pinned (commit {PINNED_COMMIT}, tree "
        f"{PINNED_SUITE_TREE}; found tree {found}). Make one with:\n"
        f"  mkdir -p DIR && git -C {MIRROR} archive {PINNED_COMMIT} {SUITE} {CLIENT_PY} | tar -x -C DIR"
    )
    if not allow_other:
        sys.exit(message + "\nor pass --allow-other-commit to run it anyway")
    print("WARNING: " + message, file=sys.stderr)


def prepare_suite(upstream: Path, unskip: bool) -> None:
    if not (HERE / "node_modules" / "tsx").is_dir():
        sys.exit(
            "the runner's npm dependencies are missing: run `make client-conformance UPSTREAM=...`"
            " or `cd ops/client_conformance && npm ci`"
        )
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir()
    suite = upstream / SUITE
    for name in ("src", "test-cases"):
        shutil.copytree(suite / name, WORK / name)
    shutil.copy2(suite / "package.json", WORK / "package.json")
    if unskip:  # the copy is run, not the checkout: the suite's tree hash was checked already
        for case_file in (WORK / "test-cases").rglob("*.yaml"):
            text = case_file.read_text()
            case_file.write_text(re.sub(r"(?m)^(\s+)skip: .*$", r"\1# (skip: dropped by --unskip)", text))


def adapter_command(kind: str, upstream: Path) -> str:
    """The executable the runner spawns (it passes no arguments): a wrapper script for the Python ones."""
    if kind == "ts":
        return "ts"
    python = sys.executable
    if kind == "ours":
        env = f'PYTHONPATH="{ROOT}${{PYTHONPATH:+:$PYTHONPATH}}"'
        target = HERE / "adapter.py"
    else:
        client_py = upstream / CLIENT_PY
        if git_tree_hash(client_py) != PINNED_CLIENT_PY_TREE:
            print(f"WARNING: {client_py} differs from the pinned commit's", file=sys.stderr)
        env = f'PYTHONPATH="{client_py / "src"}"'
        target = client_py / "conformance_adapter_async.py"
    wrapper = WORK / f"adapter-{kind}.sh"
    wrapper.write_text(f'#!/bin/sh\nexport {env}\nexec "{python}" "{target}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ops.client_conformance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--upstream", type=Path, required=True, help="the upstream repository (checkout or extract)"
    )
    parser.add_argument("--adapter", choices=["ours", "ts", "upstream-py"], default="ours")
    parser.add_argument(
        "--server",
        choices=["reference", "streamkeep"],
        default="reference",
        help="the runner's own reference server (default), or streamkeep behind a fault-injecting proxy",
    )
    parser.add_argument(
        "--serve-args",
        default="",
        help='more `streamkeep serve` flags with --server streamkeep, one string: --serve-args="--edge quart"',
    )
    parser.add_argument(
        "--backend", choices=["asyncio", "trio"], default="asyncio", help="the event loop our adapter runs on"
    )
    parser.add_argument("--allow-other-commit", action="store_true")
    parser.add_argument(
        "--unskip",
        action="store_true",
        help="run the cases the suite marks `skip:` too (upstream skips them for all)",
    )
    parser.add_argument("--log", type=Path, help="also write the runner's output here")
    parser.add_argument("runner_args", nargs="*", help="passed to the runner (after --)")
    args = parser.parse_args()

    upstream = args.upstream.resolve()
    check_upstream(upstream, args.allow_other_commit)
    prepare_suite(upstream, args.unskip)
    adapter = adapter_command(args.adapter, upstream)

    env = dict(os.environ)
    env["STREAMKEEP_ADAPTER_BACKEND"] = args.backend
    server = None
    if args.server == "streamkeep":
        from ops.serverproc import start

        # As the server suite runs it (ops/run_conformance.py), and with the reference server's
        # long-poll timeout for this suite (runner.ts: 500 ms, shorter than the cases' 1 s waits).
        server = start("--storage", "memory", "--long-poll-timeout", "0.5", *shlex.split(args.serve_args))
        print(f"streamkeep serve at {server.url}", flush=True)
        env["STREAMKEEP_URL"] = server.url
        hook = (HERE / "server-hook.mjs").as_uri()
        env["NODE_OPTIONS"] = f"{env.get('NODE_OPTIONS', '')} --import {hook}".strip()
    try:
        return run_runner(args, adapter, env)
    finally:
        if server is not None:
            server.stop()


def run_runner(args: argparse.Namespace, adapter: str, env: dict[str, str]) -> int:
    command = [str(HERE / "node_modules" / ".bin" / "tsx"), str(WORK / "src" / "cli.ts"), "--run", adapter]
    command += args.runner_args
    print("$ " + " ".join(command), flush=True)
    log = args.log.open("w") if args.log else None
    with subprocess.Popen(
        command, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as runner:
        assert runner.stdout is not None
        for line in runner.stdout:
            sys.stdout.write(line)
            if log:
                log.write(line)
        code = runner.wait()
    if log:
        log.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
