"""Run the official conformance suite against a fresh streamkeep process.

    python -m ops.run_conformance                          # HTTP/1.1, memory storage
    python -m ops.run_conformance --tls-h2                 # HTTPS, HTTP/2 negotiated by ALPN
    python -m ops.run_conformance --storage disk --tls-h2  # the same on durable disk storage
    python -m ops.run_conformance --edge quart             # through the quart-trio/hypercorn edge

All 338 tests run, subscriptions included (the server gets --allow-loopback-webhooks because the
suite's webhook receiver listens on loopback). Exits non-zero when any test fails.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from ops.serverproc import ROOT, launch, start

SUITE_DIR = ROOT / "conformance"
SUBSCRIPTION_TESTS = "Reserved subscription APIs"  # the suite's describe() of its subscription tests


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    import trustme

    authority = trustme.CA()
    certificate = authority.issue_cert("127.0.0.1", "localhost")
    ca, cert, key = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    authority.cert_pem.write_to_path(str(ca))
    certificate.private_key_pem.write_to_path(str(key))
    with cert.open("wb") as out:
        for blob in certificate.cert_chain_pems:
            out.write(blob.bytes())
    return ca, cert, key


STATS_ASKED = [0]  # this runner's own /stats requests (HTTP/1.1), beside the suite's


def server_stats(url: str, ca: Path | None, token: str | None, query: str = "") -> dict:

    STATS_ASKED[0] += 1
    import ssl
    import urllib.request

    context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
    request = urllib.request.Request(f"{url}/stats{query}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, context=context) as response:
        return json.load(response)


def subscription_crossings(view: dict) -> int:
    """How often this member's subscriptions learnt of a stream on another member (a state in an
    answer or a report) and reported its own streams to another member's subscriptions."""
    cluster = view.get("subscriptions", {}).get("cluster", {})
    reported = sum(peer.get("reported", 0) for peer in cluster.get("members", {}).values())
    return reported + cluster.get("remote_streams", 0) + cluster.get("remote_gone", 0)


def subscriptions_crossed(url: str, ca: Path | None, token: str | None) -> bool:
    members = server_stats(url, ca, token, "?cluster=1")["members"]
    return sum(subscription_crossings(view) for view in members.values()) > 0


def check_replicated(url: str, ca: Path | None, token: str | None) -> int:
    """Every member's owner must have had an in-sync follower that its commits waited for: the
    suite ran replicated, not on one copy."""
    members = server_stats(url, ca, token, "?cluster=1")["members"]
    seen = {
        member: {
            key: view.get("replication", {}).get(key)
            for key in ("replica", "epoch", "follower_in_sync", "barrier_waits", "alone_seconds")
        }
        for member, view in members.items()
    }
    print(f"conformance: replication per member: {json.dumps(seen)}")
    if all(s["follower_in_sync"] and (s["barrier_waits"] or 0) > 0 for s in seen.values()):
        return 0
    print("conformance: a member ran without an in-sync follower", file=sys.stderr)
    return 1


def check_crossed_members(url: str, ca: Path | None, token: str | None, *, http2: bool) -> int:
    """Through a cluster's front door: forks must have crossed members both ways and some
    subscription must have followed a stream on another member (the suite's names hash to both),
    or the run proved nothing about them; over TLS, clients must have spoken h2 to HAProxy."""
    members = server_stats(url, ca, token, "?cluster=1")["members"]
    crossed = {
        member: {
            "forks_of_its_streams_elsewhere": view.get("cluster_forks", {}).get("attached", 0),
            "inherited_reads_from_elsewhere": view.get("cluster_forks", {}).get("remote_reads", 0),
            "forwarded_requests": view.get("cluster", {}).get("forwarded_requests", 0),
            "client_http_versions": view.get("cluster", {}).get("requests_by_client_http_version", {}),
            "subscriptions_following_streams_elsewhere": subscription_crossings(view),
            "streams": view.get("streams"),
        }
        for member, view in sorted(members.items())
    }
    print(f"conformance: across members: {crossed}")
    if any("error" in view for view in members.values()):
        print("conformance: a member did not answer /stats", file=sys.stderr)
        return 1
    if not all(
        c["forks_of_its_streams_elsewhere"] and c["inherited_reads_from_elsewhere"] for c in crossed.values()
    ):
        print("conformance: forks did not cross members both ways", file=sys.stderr)
        return 1
    if http2:
        spoken: Counter[str] = Counter()
        for c in crossed.values():
            spoken.update(c["client_http_versions"])
        if spoken.get("2.0", 0) < 1000 or spoken.get("1.1", 0) > STATS_ASKED[0]:
            print(
                f"conformance: the suite did not reach the front door over HTTP/2: {dict(spoken)}",
                file=sys.stderr,
            )
            return 1
    return 0


def check_http2_was_used(url: str, ca: Path, token: str | None) -> int:
    """The suite cannot tell which protocol fetch used; the server's own counters can."""
    by_version = server_stats(url, ca, token)["requests_by_http_version"]
    print(f"conformance: requests by HTTP version: {by_version}")
    if by_version.get("2", 0) < 1000 or by_version.get("1.1", 0) > 1:
        print("conformance: the suite did not run over HTTP/2", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tls-h2", action="store_true", help="serve HTTPS and make the suite use HTTP/2")
    parser.add_argument("--storage", choices=("memory", "disk"), default="memory")
    parser.add_argument("--edge", choices=("lean", "quart"), default="lean")
    parser.add_argument(
        "--auth",
        action="store_true",
        help="turn auth on (an HS256 secret) and have the suite send an admin token with every request",
    )
    parser.add_argument(
        "--cluster",
        type=int,
        metavar="N",
        help="run the suite through the front door (HAProxy) of `streamkeep cluster run --processes N`",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="with --cluster: `cluster run --replicas N` (2: every member on two processes; disk storage)",
    )
    parser.add_argument("--filter", help="vitest -t pattern to run a subset (for debugging)")
    parser.add_argument("server_args", nargs="*", help="extra `streamkeep serve` arguments")
    args = parser.parse_args()

    if not (SUITE_DIR / "node_modules").is_dir():
        print("conformance/node_modules is missing: run `make conformance` (it runs npm ci)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        server_args = ["--storage", args.storage, "--data-dir", str(Path(tmp) / "data"), "--edge", args.edge]
        # The suite's webhook receiver listens on loopback.
        server_args += ["--long-poll-timeout", "0.5", "--allow-loopback-webhooks", *args.server_args]
        if args.auth:
            import jwt

            secret = secrets.token_urlsafe(32)
            server_args.append(f"--auth-jwt-secret={secret}")  # one word: a secret may start with "-"
            env["CONFORMANCE_AUTH_TOKEN"] = jwt.encode(
                {"sub": "conformance", "scope": "admin", "exp": int(time.time()) + 3600}, secret, "HS256"
            )
        if args.tls_h2:
            ca, cert, key = make_certificates(Path(tmp))
            server_args += ["--tls-cert", str(cert), "--tls-key", str(key)]
            env["NODE_EXTRA_CA_CERTS"] = str(ca)
            env["CONFORMANCE_HTTP2"] = "1"
        if args.cluster:
            from streamkeep.cluster.run import free_port

            server_args[server_args.index("--data-dir") + 1] = str(Path(tmp) / "cluster")
            command = [sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", str(args.cluster)]
            command += ["--replicas", str(args.replicas)]
            command += ["--port", str(free_port("127.0.0.1")), *server_args]
            server = launch(
                command,
                env=env,
                timeout=90,
            )
        else:
            server = start(*server_args)
        mode = (
            ("HTTPS + HTTP/2" if args.tls_h2 else "HTTP/1.1")
            + f", {args.storage} storage, {args.edge} edge"
            + (", auth on (admin token)" if args.auth else "")
            + (f", {args.replicas} replicas of each of {args.cluster} members" if args.replicas > 1 else "")
        )
        print(f"conformance: {mode} against {server.url}", flush=True)
        try:
            env["CONFORMANCE_SUBSCRIPTIONS"] = "1"
            env["CONFORMANCE_TEST_URL"] = server.url
            vitest = ["npx", "vitest", "run", "--config", "vitest.config.mjs"]
            result = subprocess.run(
                [*vitest, *(["-t", args.filter] if args.filter else [])], cwd=SUITE_DIR, env=env
            )
            if args.tls_h2 and result.returncode == 0 and not args.cluster:
                result.returncode = check_http2_was_used(
                    server.url, Path(tmp) / "ca.pem", env.get("CONFORMANCE_AUTH_TOKEN")
                )
            if args.cluster and result.returncode == 0 and not args.filter:
                # The suite names its subscriptions and streams at random: whether one follows a
                # stream on another member is chance (2 runs in 6 here had none). Its subscription
                # tests run again until one does, at most 5 times, each of them passing.
                ca_path = Path(tmp) / "ca.pem" if args.tls_h2 else None
                token = env.get("CONFORMANCE_AUTH_TOKEN")
                for again in range(5):
                    if result.returncode != 0 or subscriptions_crossed(server.url, ca_path, token):
                        break
                    print(f"conformance: no subscription crossed members yet; its tests again ({again + 1})")
                    result = subprocess.run([*vitest, "-t", SUBSCRIPTION_TESTS], cwd=SUITE_DIR, env=env)
                else:
                    if not subscriptions_crossed(server.url, ca_path, token):
                        print(
                            "conformance: no subscription followed a stream on another member",
                            file=sys.stderr,
                        )
                        result.returncode = 1
            if args.cluster and result.returncode == 0 and not args.filter:
                result.returncode = check_crossed_members(
                    server.url,
                    Path(tmp) / "ca.pem" if args.tls_h2 else None,
                    env.get("CONFORMANCE_AUTH_TOKEN"),
                    http2=args.tls_h2,
                )
            if args.replicas > 1 and result.returncode == 0 and not args.filter:
                result.returncode = check_replicated(
                    server.url,
                    Path(tmp) / "ca.pem" if args.tls_h2 else None,
                    env.get("CONFORMANCE_AUTH_TOKEN"),
                )
            if args.auth and result.returncode == 0:
                ca_path = Path(tmp) / "ca.pem" if args.tls_h2 else None
                refusals = server_stats(server.url, ca_path, env["CONFORMANCE_AUTH_TOKEN"])["auth"][
                    "refusals"
                ]
                print(f"conformance: auth refusals: {refusals}")
        finally:
            code = server.stop()
            if code not in (0, None):
                print(
                    f"streamkeep exited with {code}; its output:\n{''.join(server.output)}", file=sys.stderr
                )
    if not server.output or code not in (0, None):
        return 1
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
