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
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ops.serverproc import ROOT, start

SUITE_DIR = ROOT / "conformance"


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


def server_stats(url: str, ca: Path | None, token: str | None) -> dict:
    import json
    import ssl
    import urllib.request

    context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
    request = urllib.request.Request(f"{url}/stats")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, context=context) as response:
        return json.load(response)


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
        server = start(*server_args)
        mode = (
            "HTTPS + HTTP/2" if args.tls_h2 else "HTTP/1.1"
        ) + f", {args.storage} storage, {args.edge} edge" + (", auth on (admin token)" if args.auth else "")
        print(f"conformance: {mode} against {server.url}", flush=True)
        try:
            env["CONFORMANCE_SUBSCRIPTIONS"] = "1"
            env["CONFORMANCE_TEST_URL"] = server.url
            result = subprocess.run(
                [
                    "npx",
                    "vitest",
                    "run",
                    "--config",
                    "vitest.config.mjs",
                    *(["-t", args.filter] if args.filter else []),
                ],
                cwd=SUITE_DIR,
                env=env,
            )
            if args.tls_h2 and result.returncode == 0:
                result.returncode = check_http2_was_used(
                    server.url, Path(tmp) / "ca.pem", env.get("CONFORMANCE_AUTH_TOKEN")
                )
            if args.auth and result.returncode == 0:
                ca_path = Path(tmp) / "ca.pem" if args.tls_h2 else None
                refusals = server_stats(server.url, ca_path, env["CONFORMANCE_AUTH_TOKEN"])["auth"]["refusals"]
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
