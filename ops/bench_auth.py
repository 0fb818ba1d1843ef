"""What auth and metrics cost an append: one run, the same machine, servers side by side.

    python -m ops.bench_auth [--seconds 3] [--rounds 3] [--json FILE]

Starts streamkeep in memory in five configurations: metrics off; metrics on (the default); auth
with an HS256 secret; auth with an ES256 key from a JWKS file; and the same with the access log
on. Each round runs h2load (16 HTTP/1.1 connections, 100 B appends, one stream per connection)
against every server in turn, so drift over the run hits all of them alike; the table gives the
median appends/s, server CPU per append from /proc, and the ratio to "metrics on". A second table
times what the token cache saves: one PyJWT verification per algorithm against a cache hit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric import ec

from ops.loadtest import h2load
from ops.serverproc import ServerProcess, start

MEMORY = ["--storage", "memory", "--log-level", "warning", "--max-total-bytes", "16GiB"]
SECRET = "benchmark-secret-0123456789abcdef"
CLIENTS = 16


def _es256(work: Path) -> tuple[Path, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    jwk = jwt.algorithms.ECAlgorithm.to_jwk(key.public_key(), as_dict=True)
    jwks = work / "jwks.json"
    jwks.write_text(json.dumps({"keys": [{**jwk, "kid": "bench", "alg": "ES256", "use": "sig"}]}))
    token = jwt.encode({"sub": "bench", "scope": "write:**", "exp": int(time.time()) + 86400}, key, "ES256",
                       headers={"kid": "bench"})  # fmt: skip
    return jwks, token


def configurations(work: Path) -> dict[str, tuple[list[str], str | None]]:
    hs = jwt.encode({"sub": "bench", "scope": "write:**", "exp": int(time.time()) + 86400}, SECRET, "HS256")
    jwks, es = _es256(work)
    return {
        "metrics off": (["--no-metrics"], None),
        "metrics on (default)": ([], None),
        "auth HS256": (["--auth-jwt-secret", SECRET], hs),
        "auth ES256 (JWKS)": (["--auth-jwks-url", str(jwks)], es),
        "auth ES256 + access log": (
            ["--auth-jwks-url", str(jwks), "--access-log", str(work / "access.log")],
            es,
        ),
    }


def create(server: ServerProcess, token: str | None, count: int, run: int) -> list[str]:
    headers = {"Content-Type": "text/plain", **({"Authorization": f"Bearer {token}"} if token else {})}
    paths = [f"/v1/stream/bench-{run}-{i}" for i in range(count)]
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for path in paths:
            response = client.put(path, headers=headers)
            if response.status_code != 201:
                raise RuntimeError(f"PUT {path}: {response.status_code} {response.text}")
    return paths


def verification_costs() -> list[tuple[str, float]]:
    """Microseconds per verification, as the server's verifier does it, and per cache hit."""
    from streamkeep.auth.jwks import JwksKeys
    from streamkeep.auth.tokens import TokenVerifier

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        jwks, es = _es256(Path(tmp))
        keys = JwksKeys()
        keys.load(jwks.read_text())
        hs = jwt.encode({"sub": "b", "scope": "write:**"}, SECRET, "HS256")
        for label, token, verifier in (
            ("HS256", hs, TokenVerifier(secret=SECRET, keys=None, issuer=None, audience=None)),
            ("ES256", es, TokenVerifier(secret=None, keys=keys, issuer=None, audience=None)),
        ):
            count = 2000
            started = time.perf_counter()
            for _ in range(count):
                verifier.clear_cache()
                verifier.verify(token)
            rows.append(
                (f"{label} signature check (cache miss)", (time.perf_counter() - started) / count * 1e6)
            )
            verifier.verify(token)
            started = time.perf_counter()
            for _ in range(count * 10):
                verifier.verify(token)
            rows.append((f"{label} cache hit", (time.perf_counter() - started) / (count * 10) * 1e6))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one h2load run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per configuration (the median is kept)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not h2load.available():
        print("h2load is missing: `make h2load` installs Debian's nghttp2-client")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        body = work / "body"
        body.write_bytes(b"x" * 100)
        configs = configurations(work)
        servers = {name: start(*MEMORY, *extra) for name, (extra, _) in configs.items()}
        results: dict[str, list[h2load.Load]] = {name: [] for name in configs}
        try:
            paths = {name: create(servers[name], configs[name][1], CLIENTS, 0) for name in configs}
            for name in configs:  # warm-up: imports, caches, the token's one verification
                h2load.run(servers[name], paths[name], clients=CLIENTS, body=body, content_type="text/plain",
                           h2=False, seconds=1.0, headers=_auth(configs[name][1]))  # fmt: skip
            for round_number in range(args.rounds):
                for name in configs:
                    load = h2load.run(servers[name], paths[name], clients=CLIENTS, body=body,
                                      content_type="text/plain", h2=False, seconds=args.seconds,
                                      headers=_auth(configs[name][1]))  # fmt: skip
                    if load.failed:
                        raise RuntimeError(f"{name}: {load.failed} appends failed")
                    results[name].append(load)
                    print(f"round {round_number + 1}/{args.rounds} {name}: {load.per_second:,.0f} appends/s",
                          flush=True)  # fmt: skip
        finally:
            for server in servers.values():
                server.stop()
    base = statistics.median(load.per_second for load in results["metrics on (default)"])
    print(f"\nappends/s, {CLIENTS} HTTP/1.1 connections, 100 B, own streams, memory; "
          f"median of {args.rounds} x {args.seconds:g} s\n")  # fmt: skip
    print("| configuration | appends/s | server CPU us/append | vs metrics on |")
    print("|---|---|---|---|")
    table = {}
    for name, loads in results.items():
        rate = statistics.median(load.per_second for load in loads)
        cpu = statistics.median(load.cpu_us_per_request for load in loads)
        table[name] = {"appends_per_second": rate, "cpu_us": cpu}
        print(f"| {name} | {rate:,.0f} | {cpu:.1f} | {rate / base:.2f}x |")
    costs = verification_costs()
    print("\n| token check (in process) | us |\n|---|---|")
    for label, micros in costs:
        print(f"| {label} | {micros:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"appends": table, "verification_us": dict(costs)}, indent=2))
    return 0


def _auth(token: str | None) -> tuple[str, ...]:
    return (f"Authorization: Bearer {token}",) if token else ()


if __name__ == "__main__":
    raise SystemExit(main())
