"""Auth over real sockets, HTTP/1.1 and HTTP/2: bearer tokens (HS256 and a JWKS served over HTTPS),
scopes on canonical stream names, the `token` query parameter, signed links, CORS allow-lists,
caching headers, quotas, and subscriptions owned by their creator."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.server
import json
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jwt
import pytest
import trustme
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from ops.serverproc import ROOT, ServerProcess, start
from tests.conftest import FAST

SECRET = "test-secret-that-is-long-enough-for-hs256"
LINK_KEYS = "k1=link-secret-number-one-0123456789,k0=link-secret-number-zero-0123456789"
AUDIENCE = "streamkeep-tests"
ORIGIN = "https://app.example.com"
JSON = {"Content-Type": "application/json"}


def token(scope: str | list[str], *, sub: str = "alice", secret: str = SECRET, **claims: object) -> str:
    body: dict[str, object] = {"sub": sub, "scope": scope, "aud": AUDIENCE, "exp": int(time.time()) + 600}
    body.update(claims)
    return jwt.encode({k: v for k, v in body.items() if v is not None}, secret, "HS256")


def bearer(value: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {value}"}


ADMIN = token("admin", sub="root")


class JwksServer:
    """A JWKS over HTTPS on loopback whose keys a test can change, counting the fetches."""

    def __init__(self, directory: Path) -> None:
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1", "localhost")
        self.ca_file = directory / "jwks-ca.pem"
        ca.cert_pem.write_to_path(str(self.ca_file))
        self.keys: dict[str, object] = {}  # kid -> private key
        self.fetches = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.fetches += 1
                body = json.dumps(outer.document()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert.configure_cert(context)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}/jwks.json"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def add(self, kid: str, kind: str) -> None:
        self.keys[kid] = (
            ec.generate_private_key(ec.SECP256R1())
            if kind == "ES256"
            else ed25519.Ed25519PrivateKey.generate()
        )

    def document(self) -> dict:
        keys = []
        for kid, private in self.keys.items():
            if isinstance(private, ec.EllipticCurvePrivateKey):
                jwk = jwt.algorithms.ECAlgorithm.to_jwk(private.public_key(), as_dict=True)
                jwk["alg"] = "ES256"
            else:
                jwk = jwt.algorithms.OKPAlgorithm.to_jwk(private.public_key(), as_dict=True)
                jwk["alg"] = "EdDSA"
            keys.append({**jwk, "kid": kid, "use": "sig"})
        return {"keys": keys}

    def token(self, kid: str, scope: str, **claims: object) -> str:
        private = self.keys[kid]
        algorithm = "ES256" if isinstance(private, ec.EllipticCurvePrivateKey) else "EdDSA"
        body = {
            "sub": f"jwks-{kid}",
            "scope": scope,
            "aud": AUDIENCE,
            "exp": int(time.time()) + 600,
            **claims,
        }
        return jwt.encode(body, private, algorithm, headers={"kid": kid})  # type: ignore[arg-type]

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture(scope="module")
def jwks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JwksServer]:
    server = JwksServer(tmp_path_factory.mktemp("jwks"))
    server.add("es-1", "ES256")
    yield server
    server.close()


@pytest.fixture(scope="module")
def auth_server(jwks: JwksServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("auth-data")
    process = start(
        *FAST,
        "--auth-jwt-secret", SECRET,
        "--auth-jwks-url", jwks.url,
        "--auth-jwks-min-refresh-interval", "1",
        "--auth-audience", AUDIENCE,
        "--auth-link-keys", LINK_KEYS,
        "--cors-origins", ORIGIN,
        "--data-dir", str(data),
        env={"SSL_CERT_FILE": str(jwks.ca_file)},
    )  # fmt: skip
    yield process
    process.stop()


@pytest.fixture(params=["http/1.1", "h2c"])
def client(request: pytest.FixtureRequest, auth_server: ServerProcess) -> Iterator[httpx.Client]:
    h2 = request.param == "h2c"
    with httpx.Client(base_url=auth_server.url, http1=not h2, http2=h2, timeout=10) as c:
        yield c


_count = iter(range(1_000_000))


@pytest.fixture
def name() -> str:
    return f"team-a/s{next(_count)}-{time.monotonic_ns()}"


def created(client: httpx.Client, name: str) -> str:
    url = f"/v1/stream/{name}"
    response = client.put(url, headers={**bearer(ADMIN), **JSON})
    assert response.status_code == 201, response.text
    assert client.post(url, content=b'{"n": 1}', headers={**bearer(ADMIN), **JSON}).status_code == 204
    return url


def refused(response: httpx.Response, status: int, reason: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == reason
    if status == 401:
        assert response.headers["www-authenticate"].startswith('Bearer realm="streamkeep"')


# ---- authentication ----------------------------------------------------------------------------


def test_no_token_is_401_and_says_nothing_about_the_stream(client: httpx.Client, name: str) -> None:
    url = created(client, name)
    existing = client.get(url)
    missing = client.get(url + "-never-created")
    refused(existing, 401, "missing_token")
    refused(missing, 401, "missing_token")
    assert existing.content == missing.content
    assert existing.headers["www-authenticate"] == 'Bearer realm="streamkeep"'
    refused(client.post(url, content=b"x"), 401, "missing_token")
    refused(client.get(url, headers={"Authorization": "Basic dXNlcjpwdw=="}), 401, "malformed_token")


@pytest.mark.parametrize(
    ("credential", "reason"),
    [
        (lambda: token("admin", exp=int(time.time()) - 3600), "expired"),
        (lambda: token("admin", nbf=int(time.time()) + 3600), "not_yet_valid"),
        (lambda: token("admin", secret="another-secret-entirely-0123456789"), "bad_signature"),
        (lambda: token("admin", aud="some-other-service"), "bad_audience"),
        (lambda: "not.a.jwt", "malformed_token"),
    ],
    ids=["expired", "not-yet-valid", "wrong-signature", "wrong-audience", "garbage"],
)
def test_invalid_tokens_are_401(client: httpx.Client, name: str, credential, reason: str) -> None:  # type: ignore[no-untyped-def]
    url = created(client, name)
    response = client.get(url, headers=bearer(credential()))
    refused(response, 401, reason)
    assert 'error="invalid_token"' in response.headers["www-authenticate"]


# ---- scopes ----------------------------------------------------------------------------------


def test_scopes_decide_each_operation(client: httpx.Client, name: str) -> None:
    url = created(client, name)
    reader = bearer(token("read:team-a/*"))
    appender = bearer(token("append:team-a/**"))
    other_team = bearer(token("read:team-b/*"))
    writer = bearer(token("write:team-a/**"))

    refused(client.post(url, content=b"{}", headers={**reader, **JSON}), 403, "insufficient_scope")
    refused(client.get(url, headers=other_team), 403, "insufficient_scope")
    refused(client.put(url + "-new", headers={**appender, **JSON}), 403, "insufficient_scope")
    refused(client.delete(url, headers=appender), 403, "insufficient_scope")
    refused(client.get(url, headers=appender), 403, "insufficient_scope")  # append does not read

    assert client.get(url + "?offset=-1", headers=reader).status_code == 200
    assert client.head(url, headers=reader).status_code == 200
    assert client.post(url, content=b'{"n": 2}', headers={**appender, **JSON}).status_code == 204
    assert client.put(url + "-w", headers={**writer, **JSON}).status_code == 201
    assert client.post(url + "-w", content=b"{}", headers={**writer, **JSON}).status_code == 204
    assert client.get(url + "-w?offset=-1", headers=writer).status_code == 200  # write implies read
    assert client.delete(url + "-w", headers=writer).status_code == 204
    # 403 never says whether the stream exists: the same answer for a name never created.
    existing, missing = client.get(url, headers=other_team), client.get(url + "-none", headers=other_team)
    assert (existing.status_code, existing.json()["error"]["code"]) == (
        missing.status_code,
        missing.json()["error"]["code"],
    )


def test_scopes_match_the_decoded_name_not_the_raw_path(client: httpx.Client) -> None:
    scoped = bearer(token("write:team-a/**"))
    # %2F decodes to '/', so this names team-a/x: the grant holds although the raw path differs.
    assert (
        client.put(f"/v1/stream/team-a%2Fenc-{time.monotonic_ns()}", headers={**scoped, **JSON}).status_code
        == 201
    )
    # team-b%2F.. cannot climb into team-a: the name is checked after decoding, and `..` is refused.
    assert client.put("/v1/stream/team-a/..%2Fteam-b/x", headers={**scoped, **JSON}).status_code == 400
    refused(client.put("/v1/stream/team-b%2Fx", headers={**scoped, **JSON}), 403, "insufficient_scope")


def test_scope_claim_may_be_an_array(client: httpx.Client, name: str) -> None:
    url = created(client, name)
    assert client.get(url, headers=bearer(token(["read:team-a/*", "openid"]))).status_code == 200


def test_fork_needs_read_on_source_and_write_on_itself(client: httpx.Client, name: str) -> None:
    url = created(client, name)
    fork = {"Stream-Forked-From": url, **JSON}
    write_b_only = bearer(token("write:team-b/**"))
    refused(
        client.put(f"/v1/stream/team-b/fork-{next(_count)}", headers={**write_b_only, **fork}),
        403,
        "insufficient_scope",
    )
    both = bearer(token("write:team-b/** read:team-a/**"))
    assert client.put(f"/v1/stream/team-b/fork-{next(_count)}", headers={**both, **fork}).status_code == 201


def test_admin_endpoints_need_admin(client: httpx.Client) -> None:
    writer = bearer(token("write:**"))
    refused(client.get("/stats", headers=writer), 403, "insufficient_scope")
    refused(client.get("/metrics", headers=writer), 403, "insufficient_scope")
    refused(client.get("/metrics"), 401, "missing_token")
    assert client.get("/stats", headers=bearer(ADMIN)).status_code == 200
    assert client.get("/metrics", headers=bearer(ADMIN)).status_code == 200
    # Probes stay open: a load balancer has no token.
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200


# ---- tokens in the URL, for EventSource --------------------------------------------------------


def test_token_query_parameter_on_sse(client: httpx.Client, name: str) -> None:
    url = created(client, name)
    reader = token("read:team-a/*")
    with client.stream("GET", f"{url}?offset=-1&live=sse&token={reader}") as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        seen = b""
        for chunk in response.iter_bytes():
            seen += chunk
            if b"upToDate" in seen:
                break
    assert b'"n": 1' in seen or b'"n":1' in seen
    # Only reads take it from the URL: an append must send the header.
    refused(
        client.post(f"{url}?token={token('write:**')}", content=b"{}", headers=JSON), 401, "missing_token"
    )


# ---- JWKS ------------------------------------------------------------------------------------


def test_jwks_tokens_and_rotation(client: httpx.Client, jwks: JwksServer, name: str) -> None:
    url = created(client, name)
    assert client.get(url, headers=bearer(jwks.token("es-1", "read:team-a/*"))).status_code == 200
    kid = f"ed-{next(_count)}"
    jwks.add(kid, "EdDSA")  # the issuer rotates: a new key appears in its JWKS
    time.sleep(1.1)  # past the refresh rate limit of this server (--auth-jwks-min-refresh-interval 1)
    before = jwks.fetches
    assert client.get(url, headers=bearer(jwks.token(kid, "read:team-a/*"))).status_code == 200
    assert jwks.fetches == before + 1  # fetched once, on the unknown kid


def test_random_kids_cannot_flood_the_jwks(client: httpx.Client, jwks: JwksServer, name: str) -> None:
    url = created(client, name)
    time.sleep(1.1)
    before = jwks.fetches
    forged = ed25519.Ed25519PrivateKey.generate()
    for n in range(20):
        value = jwt.encode(
            {"scope": "admin", "aud": AUDIENCE}, forged, "EdDSA", headers={"kid": f"random-{n}"}
        )  # type: ignore[arg-type]
        refused(client.get(url, headers=bearer(value)), 401, "unknown_key")
    assert jwks.fetches - before <= 1


def test_hs256_signed_with_a_public_key_is_refused(client: httpx.Client, jwks: JwksServer, name: str) -> None:
    url = created(client, name)
    # The classic confusion: HS256 "signed" with the issuer's public key, which anyone can fetch.
    # PyJWT refuses to make such a token, so it is made by hand.
    public_jwk = json.dumps(jwks.document()["keys"][0]).encode()
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "es-1"}).encode())
    claims = _b64(json.dumps({"scope": "admin", "aud": AUDIENCE, "exp": int(time.time()) + 600}).encode())
    signature = _b64(hmac.new(public_jwk, f"{header}.{claims}".encode(), hashlib.sha256).digest())
    response = client.get(url, headers=bearer(f"{header}.{claims}.{signature}"))
    assert response.status_code == 401, response.text


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


# ---- signed links ----------------------------------------------------------------------------


def sign(stream: str, *, ttl: str = "1h", base: str, keys: str = LINK_KEYS) -> str:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamkeep",
            "sign",
            stream,
            "--ttl",
            ttl,
            "--base-url",
            base,
            "--auth-link-keys",
            keys,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


def test_signed_links(client: httpx.Client, auth_server: ServerProcess, name: str) -> None:
    url = created(client, name)
    link = sign(name, base=auth_server.url)
    assert link.startswith(f"{auth_server.url}/v1/stream/{name}?signed=")
    good = client.get(link + "&offset=-1")
    assert good.status_code == 200 and good.json() == [{"n": 1}]
    with client.stream("GET", link + "&offset=-1&live=sse") as response:
        assert response.status_code == 200
    # It grants reading only: no appends through it.
    refused(client.post(link, content=b"{}", headers=JSON), 401, "missing_token")
    # Another stream, a tampered signature, an expired link, a key the server does not have.
    other = created(client, name + "-other")
    value = link.split("signed=", 1)[1]
    refused(client.get(f"{other}?signed={value}"), 401, "bad_link")
    tampered = value[:-2] + ("AA" if not value.endswith("AA") else "BB")
    refused(client.get(f"{url}?signed={tampered}"), 401, "bad_link")
    expired = sign(name, ttl="1s", base=auth_server.url)
    time.sleep(2.1)
    refused(client.get(expired), 401, "expired_link")
    unknown = sign(name, base=auth_server.url, keys="k9=some-other-link-secret-0123456789")
    refused(client.get(unknown), 401, "bad_link")
    # Rotation: a link signed with the older key k0 still works while the server keeps it.
    older = sign(name, base=auth_server.url, keys="k0=link-secret-number-zero-0123456789")
    assert client.get(older).status_code == 200


# ---- CORS and caches --------------------------------------------------------------------------


def test_cors_allow_list(client: httpx.Client, name: str) -> None:
    url = created(client, name)
    allowed = client.get(url, headers={**bearer(ADMIN), "Origin": ORIGIN})
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "Origin" in allowed.headers.get_list("vary")
    other = client.get(url, headers={**bearer(ADMIN), "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    preflight = client.options(url, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 204  # no token needed: browsers send none with a preflight
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "Authorization" in preflight.headers["access-control-allow-headers"]


def test_reads_are_private_to_caches(client: httpx.Client, name: str) -> None:
    url = created(client, name)
    response = client.get(url + "?offset=-1", headers=bearer(ADMIN))
    assert response.headers["cache-control"].startswith("private")
    assert "Authorization" in response.headers.get_list("vary")


# ---- quotas ----------------------------------------------------------------------------------


def test_append_quota_answers_429(tmp_path: Path) -> None:
    server = start(
        *FAST, "--auth-jwt-secret", SECRET, "--quota-appends-per-second", "5", "--quota-burst", "1"
    )
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            alice, bob = bearer(token("write:**", aud=None)), bearer(token("write:**", sub="bob", aud=None))
            assert client.put("/v1/stream/q", headers={**alice, **JSON}).status_code == 201
            statuses = [
                client.post("/v1/stream/q", content=b"{}", headers={**alice, **JSON}) for _ in range(12)
            ]
            limited = [r for r in statuses if r.status_code == 429]
            assert limited, [r.status_code for r in statuses]
            assert int(limited[0].headers["retry-after"]) >= 1
            assert limited[0].json()["error"]["code"] == "quota"
            # One tenant's quota is not another's.
            assert client.post("/v1/stream/q", content=b"{}", headers={**bob, **JSON}).status_code == 204
            time.sleep(1.2)
            assert client.post("/v1/stream/q", content=b"{}", headers={**alice, **JSON}).status_code == 204
    finally:
        server.stop()


# ---- subscriptions ---------------------------------------------------------------------------


def test_subscriptions_follow_only_what_their_creator_may_read(client: httpx.Client) -> None:
    tag = f"{next(_count)}-{time.monotonic_ns()}"
    mine, theirs = f"team-a/sub-{tag}", f"team-b/sub-{tag}"
    for stream in (mine, theirs):
        assert client.put(f"/v1/stream/{stream}", headers={**bearer(ADMIN), **JSON}).status_code == 201
    alice = bearer(token("read:team-a/** write:team-a/**"))
    sub_url = f"/v1/stream/__ds/subscriptions/s-{tag}"
    body = {"type": "pull-wake", "pattern": f"**/sub-{tag}", "wake_stream": f"team-a/wake-{tag}"}
    assert client.put(f"/v1/stream/team-a/wake-{tag}", headers={**bearer(ADMIN), **JSON}).status_code == 201
    response = client.put(sub_url, json=body, headers=alice)
    assert response.status_code == 201, response.text
    linked = {entry["path"] for entry in response.json()["streams"]}
    assert mine in linked and theirs not in linked, linked
    # A stream created later under team-b is not linked either: the creator's grants are checked
    # every time a stream would be linked.
    later = f"team-b/later/sub-{tag}"
    assert client.put(f"/v1/stream/{later}", headers={**bearer(ADMIN), **JSON}).status_code == 201
    also_mine = f"team-a/later/sub-{tag}"
    assert client.put(f"/v1/stream/{also_mine}", headers={**bearer(ADMIN), **JSON}).status_code == 201
    linked = {entry["path"] for entry in client.get(sub_url, headers=alice).json()["streams"]}
    assert also_mine in linked and later not in linked, linked
    # Another subject does not see it; an admin does; without a token, 401.
    refused(
        client.get(sub_url, headers=bearer(token("read:**", sub="mallory"))), 404, "SUBSCRIPTION_NOT_FOUND"
    )
    assert client.get(sub_url, headers=bearer(ADMIN)).status_code == 200
    refused(client.get(sub_url), 401, "missing_token")
    # Naming a stream the creator may not read is refused.
    named = {"type": "pull-wake", "streams": [theirs], "wake_stream": f"team-a/wake-{tag}"}
    assert client.put(sub_url + "-named", json=named, headers=alice).status_code == 403


# ---- what review found (each failed before its fix) ---------------------------------------------


def test_closing_a_stream_needs_write(client: httpx.Client, name: str) -> None:
    url = created(client, name)
    close = {"Stream-Closed": "true", **JSON}
    refused(
        client.post(url, headers={**bearer(token("append:team-a/**")), **close}), 403, "insufficient_scope"
    )
    assert (
        client.post(
            url, content=b'{"n": 2}', headers={**bearer(token("append:team-a/**")), **JSON}
        ).status_code
        == 204
    )
    assert client.post(url, headers={**bearer(token("write:team-a/**")), **close}).status_code == 204


def test_quota_counts_creates_and_tokens_without_sub_however_spelt() -> None:
    server = start(
        *FAST, "--auth-jwt-secret", SECRET, "--quota-appends-per-second", "2", "--quota-burst", "1"
    )
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            anonymous = token("write:**", sub=None, aud=None)
            spellings = [
                f"Bearer {anonymous}",
                f"bearer {anonymous}",
                f"BEARER {anonymous}",
                f"Bearer  {anonymous}",
            ]
            statuses = [
                client.put(f"/v1/stream/anon-{n}", headers={"Authorization": spelling, **JSON}).status_code
                for n, spelling in enumerate(spellings * 2)
            ]
            assert 429 in statuses, statuses  # creates are charged, and one token is one bucket
    finally:
        server.stop()


def test_narrow_token_of_the_same_subject_cannot_manage_a_subscription(client: httpx.Client) -> None:
    tag = f"{next(_count)}-{time.monotonic_ns()}"
    broad = bearer(token("read:team-a/** write:team-a/**", sub="carol"))
    narrow = bearer(token(f"read:team-a/public-{tag}", sub="carol"))
    sub_url = f"/v1/stream/__ds/subscriptions/n-{tag}"
    wake = f"team-a/wake-n-{tag}"
    assert client.put(f"/v1/stream/{wake}", headers={**broad, **JSON}).status_code == 201
    body = {"type": "pull-wake", "pattern": "team-a/**", "wake_stream": wake}
    assert client.put(sub_url, json=body, headers=broad).status_code == 201
    refused(client.get(sub_url, headers=narrow), 404, "SUBSCRIPTION_NOT_FOUND")
    refused(client.delete(sub_url, headers=narrow), 404, "SUBSCRIPTION_NOT_FOUND")
    assert client.get(sub_url, headers=broad).status_code == 200
    # A token with no sub cannot create one it could never manage.
    anonymous = bearer(token("read:team-a/**", sub=None))
    assert client.put(sub_url + "-anon", json=body, headers=anonymous).status_code == 403


def test_wake_endpoints_do_not_reveal_which_ids_exist(client: httpx.Client) -> None:
    tag = f"{next(_count)}-{time.monotonic_ns()}"
    sub_url = f"/v1/stream/__ds/subscriptions/w-{tag}"
    wake = f"team-a/wake-w-{tag}"
    assert client.put(f"/v1/stream/{wake}", headers={**bearer(ADMIN), **JSON}).status_code == 201
    body = {"type": "pull-wake", "pattern": "team-a/**", "wake_stream": wake}
    assert client.put(sub_url, json=body, headers=bearer(ADMIN)).status_code == 201
    existing = client.post(sub_url + "/release", json={}, headers=bearer("forged"))
    missing = client.post(sub_url + "-none/release", json={}, headers=bearer("forged"))
    assert existing.status_code == missing.status_code == 401


def test_sse_ends_when_its_token_expires(client: httpx.Client, name: str) -> None:
    url = created(client, name)
    short = token("read:team-a/*", exp=int(time.time()) + 2)
    started = time.monotonic()
    with client.stream("GET", f"{url}?offset=-1&live=sse&token={short}") as response:
        assert response.status_code == 200
        for _ in response.iter_bytes():
            pass
    assert time.monotonic() - started < 4.5  # --sse-close-after is 5 s here; the token's exp came first
