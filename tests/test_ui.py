"""The stream browser over HTTP: its files and their CSP, the sandbox CSP on everything else, the
admin API it reads (shape, filters, auth), `--no-ui`, the start-up warning, and its JavaScript
(syntax, and the glob filter agreeing with the server's). The page itself runs in
tests/test_ui_browser.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jwt
import pytest

from ops.serverproc import ServerProcess, start
from streamkeep import config
from streamkeep.protocol import routes
from streamkeep.protocol.globs import glob_match
from streamkeep.protocol.model import Headers, Request
from streamkeep.ui import CSP, UiFiles, exposure_warning, is_loopback
from tests.conftest import FAST

STATIC = Path(__file__).resolve().parent.parent / "streamkeep" / "ui" / "static"
SECRET = "ui-test-secret-that-is-long-enough-for-hs256"
JSON = {"Content-Type": "application/json"}


def bearer(scope: str, sub: str = "alice") -> dict[str, str]:
    claims = {"sub": sub, "scope": scope, "exp": int(time.time()) + 600}
    return {"Authorization": "Bearer " + jwt.encode(claims, SECRET, "HS256")}


def csp(response: httpx.Response) -> list[str]:
    return response.headers.get_list("content-security-policy")


# ---- the files -----------------------------------------------------------------------------


def test_the_ui_is_served_with_a_strict_csp_of_its_own(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=5) as client:
        page = client.get("/ui/")
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        assert '<script type="module" src="app.js">' in page.text
        assert csp(page) == [CSP]  # its own and only its own: not also `sandbox`
        policy = CSP.split("; ")
        assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert "script-src 'self'" in policy and "unsafe" not in CSP
        assert page.headers["x-frame-options"] == "DENY"
        assert page.headers["x-content-type-options"] == "nosniff"
        for name in ("app.js", "api.js", "streams.js", "stream.js", "chart.js"):
            module = client.get(f"/ui/{name}")
            assert module.status_code == 200, name
            assert module.headers["content-type"] == "text/javascript; charset=utf-8"
            assert csp(module) == [CSP]
        assert client.get("/ui/style.css").headers["content-type"] == "text/css; charset=utf-8"
        again = client.get("/ui/", headers={"If-None-Match": page.headers["etag"]})
        assert again.status_code == 304 and again.content == b""
        bare = client.get("/ui")
        assert bare.status_code == 308 and bare.headers["location"] == "/ui/"
        for missing in ("/ui/nope.js", "/ui/../pyproject.toml", "/ui/%2e%2e/service.py", "/ui/static/app.js"):
            assert client.get(missing).status_code == 404, missing
        assert client.head("/ui/app.js").status_code == 200


def test_the_pages_hold_no_inline_script_or_style() -> None:
    html = (STATIC / "index.html").read_text()
    for tag in re.findall(r"<script\b[^>]*>", html):
        assert "src=" in tag  # the CSP would refuse an inline one anyway; keep it honest
    assert "<style" not in html and " style=" not in html and "onclick" not in html
    for module in STATIC.glob("*.js"):
        source = module.read_text()
        # Stream content becomes text only; the token goes in a header only (never EventSource,
        # which cannot send one, nor ?token=), kept in sessionStorage; nothing from elsewhere.
        for risky in (
            r"\.(inner|outer)HTML\b",
            r"insertAdjacentHTML\(",
            r"document\.write",
            r"\beval\(",
            r"new EventSource",
            r"localStorage\.[a-z]",
            r"token=",
            r"document\.cookie",
        ):
            assert not re.search(risky, source), f"{module.name}: {risky}"
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", source), module.name


def test_stream_responses_are_sandboxed(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=5) as client:
        name = f"/v1/stream/ui-sandbox-{time.monotonic_ns()}"
        created = client.put(
            name, headers={"Content-Type": "text/html"}, content=b"<script>alert(1)</script>"
        )
        assert csp(created) == ["sandbox"]
        read = client.get(name, params={"offset": "-1"})
        assert read.status_code == 200 and read.headers["content-type"] == "text/html"
        assert csp(read) == ["sandbox"] and read.headers["x-content-type-options"] == "nosniff"
        assert csp(client.get(name)) == ["sandbox"]  # without an offset too
        assert csp(client.head(name)) == ["sandbox"]
        assert csp(client.get(name + "-missing")) == ["sandbox"]
        with client.stream("GET", name, params={"offset": "-1", "live": "sse"}) as sse:
            assert csp(sse) == ["sandbox"]
        assert csp(client.get("/v1/admin/streams")) == ["sandbox"]
        assert csp(client.get("/stats")) == ["sandbox"]
        # Answers the edge gives before the service sees the request (found by review).
        too_big = client.post(name, content=b"x" * (65 << 20), headers={"Content-Type": "text/html"})
        assert too_big.status_code == 413 and csp(too_big) == ["sandbox"]


# ---- the admin API -------------------------------------------------------------------------


def test_admin_api_lists_streams_and_details_one(server: ServerProcess) -> None:
    prefix = f"ui-admin-{time.monotonic_ns()}"
    with httpx.Client(base_url=server.url, timeout=5) as client:
        orders = f"/v1/stream/{prefix}/orders"
        assert client.put(orders, headers=JSON).status_code == 201
        producer = {"Producer-Id": "p-1", "Producer-Epoch": "3", "Producer-Seq": "0"}
        assert client.post(orders, json={"n": 1}, headers=producer).status_code == 200
        assert client.post(orders, json=[{"n": 2}, {"n": 3}]).status_code == 204
        fork = {"Content-Type": "application/json", "Stream-Forked-From": orders}
        assert client.put(f"/v1/stream/{prefix}/replay", headers=fork).status_code == 201
        assert client.put(f"/v1/stream/{prefix}/done", headers={"Stream-Closed": "true"}).status_code == 201
        assert client.put(f"/v1/stream/{prefix}/wake", headers=JSON).status_code == 201
        sub = {"type": "pull-wake", "pattern": f"{prefix}/*", "wake_stream": f"{prefix}/wake"}
        assert client.put(f"/v1/stream/__ds/subscriptions/{prefix}", json=sub).status_code == 201

        listed = client.get("/v1/admin/streams", params={"match": f"{prefix}/*"})
        assert listed.status_code == 200 and listed.headers["cache-control"] == "no-store"
        body = listed.json()
        names = [row["name"] for row in body["streams"]]
        assert names == [f"{prefix}/{n}" for n in ("done", "orders", "replay", "wake")]
        assert body["total"] == 4 and body["truncated"] is False
        assert set(body["server"]) == {"streams", "stored_bytes", "appends", "appended_bytes", "live_readers"}
        rows = {row["name"].rpartition("/")[2]: row for row in body["streams"]}
        row = rows["orders"]
        assert set(row) == {
            "name",
            "content_type",
            "created_at",
            "next_offset",
            "earliest_offset",
            "size",
            "hot_bytes",
            "cold_bytes",
            "closed",
            "expired",
            "deleted",
            "ttl_seconds",
            "expires_at",
            "forked_from",
            "fork_count",
            "appends",
            "live_readers",
        }
        assert row["content_type"] == "application/json" and row["size"] == len('{"n":1}{"n":2}{"n":3}')
        assert row["hot_bytes"] == row["size"] and row["cold_bytes"] == 0
        assert row["appends"] == 2 and row["fork_count"] == 1 and row["closed"] is False
        assert row["next_offset"] == client.head(orders).headers["stream-next-offset"]
        assert rows["done"]["closed"] is True and rows["done"]["content_type"] == "application/octet-stream"
        assert rows["replay"]["forked_from"] == f"{prefix}/orders" and rows["replay"]["size"] == row["size"]
        assert rows["replay"]["hot_bytes"] == 0  # a fork holds none of its source's bytes

        limited = client.get("/v1/admin/streams", params={"match": f"{prefix}/**", "limit": "2"}).json()
        assert len(limited["streams"]) == 2 and limited["total"] == 4 and limited["truncated"] is True
        assert client.get("/v1/admin/streams", params={"limit": "0"}).status_code == 400

        detail = client.get(f"/v1/admin/streams/{prefix}/orders").json()
        assert {k: detail[k] for k in row} == {**row, "live_readers": detail["live_readers"]}
        assert (
            detail["producers"] == [{"id": "p-1", "epoch": 3, "last_seq": 0}]
            and detail["producers_total"] == 1
        )
        assert detail["forks"] == [f"{prefix}/replay"]
        [linked] = detail["subscriptions"]
        assert linked["id"] == prefix and linked["type"] == "pull-wake" and linked["pattern"] == f"{prefix}/*"
        # Linked at the tail it had when the subscription was made; what comes after is pending.
        assert linked["link_type"] == "glob" and linked["acked_offset"] == row["next_offset"]
        assert linked["pending_bytes"] == 0
        assert client.post(orders, json={"n": 4}).status_code == 204
        [linked] = client.get(f"/v1/admin/streams/{prefix}/orders").json()["subscriptions"]
        assert linked["pending_bytes"] == len('{"n":4}')
        replay = client.get(f"/v1/admin/streams/{prefix}/replay").json()
        assert replay["fork_base_offset"] == row["next_offset"] and replay["producers"] == []

        with client.stream("GET", orders, params={"offset": "now", "live": "sse"}) as sse:
            chunks = sse.iter_bytes()  # kept: a dropped iterator closes the response
            next(chunks)
            assert client.get(f"/v1/admin/streams/{prefix}/orders").json()["live_readers"] == 1
        missing = client.get(f"/v1/admin/streams/{prefix}/missing")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "stream_not_found"
        assert client.get("/v1/admin/streams/a/%2e%2e/b").status_code == 400


# ---- off, auth, the warning --------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_ui_server() -> Iterator[ServerProcess]:
    process = start(*FAST, "--no-ui")
    yield process
    process.stop()


def test_no_ui_turns_the_files_off_not_the_api(no_ui_server: ServerProcess) -> None:
    with httpx.Client(base_url=no_ui_server.url, timeout=5) as client:
        for path in ("/ui/", "/ui", "/ui/app.js"):
            assert client.get(path).status_code == 404
        assert client.get("/v1/admin/streams").status_code == 200
    assert not any("stream browser" in line for line in no_ui_server.output)


def test_the_ui_setting_follows_every_layer(tmp_path: Path) -> None:
    assert config.load(env={}).ui.enabled is True
    assert config.load(env={"DS_UI__ENABLED": "false"}).ui.enabled is False
    toml = tmp_path / "streamkeep.toml"
    toml.write_text("[ui]\nenabled = false\n")
    assert config.load(str(toml), env={}).ui.enabled is False
    assert config.load(env={}, cli={"ui_enabled": False}).ui.enabled is False


@pytest.fixture(scope="module")
def auth_server() -> Iterator[ServerProcess]:
    process = start(*FAST, "--auth-jwt-secret", SECRET)
    yield process
    process.stop()


def test_with_auth_the_files_are_public_and_the_api_is_not(auth_server: ServerProcess) -> None:
    admin = bearer("admin", sub="root")
    team = bearer("read:team-a/**")
    with httpx.Client(base_url=auth_server.url, timeout=5) as client:
        for name in ("team-a/one", "team-b/two"):
            assert client.put(f"/v1/stream/{name}", headers=admin).status_code == 201
        assert client.get("/ui/").status_code == 200  # a browser opening the page has no token yet
        assert client.get("/ui/app.js").status_code == 200
        refused = client.get("/v1/admin/streams")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_token"
        assert client.get("/v1/admin/streams/team-a/one").status_code == 401
        assert client.get("/v1/admin/streams", headers={"Authorization": "Bearer bad"}).status_code == 401

        everything = client.get("/v1/admin/streams", headers=admin).json()
        assert {"team-a/one", "team-b/two"} <= {row["name"] for row in everything["streams"]}
        assert "server" in everything
        mine = client.get("/v1/admin/streams", headers=team).json()
        assert [row["name"] for row in mine["streams"]] == ["team-a/one"] and "server" not in mine
        # By the gate's rule for reads: a glob, even `read:**`, does not reach `__registry__`.
        every_glob = client.get("/v1/admin/streams", headers=bearer("read:**")).json()
        assert {"team-a/one", "team-b/two"} <= {row["name"] for row in every_glob["streams"]}
        registry = client.get("/v1/stream/__registry__", params={"offset": "-1"}, headers=bearer("read:**"))
        listed = "__registry__" in {row["name"] for row in every_glob["streams"]}
        assert listed == (registry.status_code == 200)
        assert client.get("/v1/admin/streams/team-a/one", headers=team).status_code == 200
        other = client.get("/v1/admin/streams/team-b/two", headers=team)
        assert other.status_code == 403 and other.json()["error"]["code"] == "insufficient_scope"
        # 403 whether or not it exists: the API tells a reader nothing the stream API would not.
        assert client.get("/v1/admin/streams/team-b/none", headers=team).status_code == 403
        # A fork another team made of team-a's stream is not named to team-a, nor its source to a
        # reader of the fork alone (found by review).
        fork = {**admin, "Stream-Forked-From": "/v1/stream/team-a/one"}
        assert client.put("/v1/stream/team-b/fork", headers=fork).status_code == 201
        detail = client.get("/v1/admin/streams/team-a/one", headers=team).json()
        assert detail["forks"] == []
        assert client.get("/v1/admin/streams/team-a/one", headers=admin).json()["forks"] == ["team-b/fork"]
        b_only = bearer("read:team-b/**")
        seen = client.get("/v1/admin/streams/team-b/fork", headers=b_only).json()
        assert seen["forked_from"] is None and seen["fork_base_offset"] is None
        listed = client.get("/v1/admin/streams", headers=b_only).json()["streams"]
        assert [row["forked_from"] for row in listed if row["name"] == "team-b/fork"] == [None]


def test_the_exposure_warning() -> None:
    assert exposure_warning("127.0.0.1", ui_on=True, auth_on=False) is None
    assert exposure_warning("::1", ui_on=True, auth_on=False) is None
    assert exposure_warning("localhost", ui_on=True, auth_on=False) is None
    assert exposure_warning("0.0.0.0", ui_on=True, auth_on=True) is None
    assert exposure_warning("0.0.0.0", ui_on=False, auth_on=False) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "streams.example.com", ""):
        warning = exposure_warning(host, ui_on=True, auth_on=False)
        assert warning is not None and "auth is off" in warning, host
    assert is_loopback("127.0.0.2") and is_loopback("[::1]") and not is_loopback("192.168.1.1")


def test_a_server_on_every_address_without_auth_warns_at_start() -> None:
    process = start(*FAST, "--host", "0.0.0.0")
    try:
        deadline = time.monotonic() + 5
        while not any("auth is off" in line for line in process.output) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("WARNING" in line and "stream browser" in line for line in process.output), process.output
    finally:
        process.stop()


# ---- routing and the JavaScript --------------------------------------------------------------


def test_routes_classify_the_ui_and_the_admin_api() -> None:
    def kind(method: str, path: str) -> routes.Route:
        return routes.classify(Request(method, path, headers=Headers()))

    assert kind("GET", "/ui/").kind == routes.UI and kind("HEAD", "/ui").kind == routes.UI
    assert kind("POST", "/ui/").kind == routes.OTHER
    assert kind("GET", "/v1/admin/streams").kind == routes.ADMIN_STREAMS
    assert kind("GET", "/v1/admin/streams/a%2Fb") == routes.Route(routes.ADMIN_STREAM, "a/b")
    assert routes.NEEDS[routes.ADMIN_STREAM] == "read"


def test_files_are_loaded_once_from_the_package() -> None:
    files = UiFiles()
    assert {"index.html", "app.js", "api.js", "streams.js", "stream.js", "chart.js", "style.css"} <= set(
        files.files
    )
    assert sum(len(body) for body, _, _ in files.files.values()) < 100_000  # small and legible


NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="needs node (make unit installs the Node packages anyway)")
def test_the_modules_parse() -> None:
    for module in STATIC.glob("*.js"):
        checked = subprocess.run(
            [NODE, "--input-type=module", "--check"], input=module.read_text(), capture_output=True, text=True
        )
        assert checked.returncode == 0, f"{module.name}: {checked.stderr}"


@pytest.mark.skipif(NODE is None, reason="needs node")
def test_the_glob_filter_matches_like_the_server() -> None:
    patterns = ["a/*", "a/**", "**", "**/b", "a/**/b", "*/b", "a*", "a*c/*", "**/x*y/**", "a/*/c", "a/**/**"]
    names = [
        "a",
        "a/b",
        "a/b/c",
        "b",
        "x/b",
        "abc/d",
        "a/c",
        "axzy",
        "q/xzzy/r/s",
        "a/bb/c",
        "a.b/c",
        "a/x/y/b",
    ]
    cases = [(pattern, name) for pattern in patterns for name in names]
    script = (
        f"import {{ globMatcher }} from {json.dumps((STATIC / 'api.js').as_uri())};"
        "const cases = JSON.parse(process.argv[1]);"
        "console.log(JSON.stringify(cases.map(([p, n]) => globMatcher(p)(n))));"
    )
    out = subprocess.run(
        [NODE, "--input-type=module", "-e", script, json.dumps(cases)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == [glob_match(pattern, name) for pattern, name in cases]
