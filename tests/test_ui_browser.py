"""The stream browser in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`, installed by `make unit`) driven with Selenium against a real server.

What a person would check by hand: streams created and deleted over HTTP come and go in the list
without a reload; a message appended over HTTP shows in a stream's live tail within 2 s; the
append box appends; delete deletes; with auth on and no token the page says 401; and a stream of
text/html or SVG holding a script, opened directly, cannot run it in the UI's origin.

`STREAMKEEP_SCREENSHOTS=1` also saves docs/ui-streams.png and docs/ui-stream.png (docs/stream-browser.md's).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import jwt
import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from ops.serverproc import ROOT, ServerProcess, start
from tests.conftest import FAST

SECRET = "ui-test-secret-that-is-long-enough-for-hs256"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SCREENSHOTS = os.environ.get("STREAMKEEP_SCREENSHOTS") == "1"

if CHROMIUM is None or CHROMEDRIVER is None:  # never skipped into green: `make unit` installs them
    raise RuntimeError(
        "chromium and chromedriver are missing: make unit (apt-get install chromium chromium-driver)"
    )


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1360,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console
    driver = webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(autouse=True)
def no_script_errors(request: pytest.FixtureRequest, browser: webdriver.Chrome) -> Iterator[None]:
    """Every test but the hostile one leaves the console without script errors."""
    script_errors(browser)
    yield
    errors = script_errors(browser)
    if "cannot_run_script" not in request.node.name:  # its stream's blocked script logs, as it should
        assert not errors, errors


@pytest.fixture(scope="module")
def open_server() -> Iterator[ServerProcess]:
    process = start(*FAST)
    yield process
    process.stop()


# With `__registry__` the list follows it live; with --no-registry it polls the admin API. Both
# ways are tested.
@pytest.fixture(scope="module")
def polling_server() -> Iterator[ServerProcess]:
    process = start(*FAST, "--no-registry")
    yield process
    process.stop()


@pytest.fixture(params=["registry", "polling"])
def list_server(request: pytest.FixtureRequest) -> tuple[ServerProcess, str]:
    fixture = "open_server" if request.param == "registry" else "polling_server"
    return request.getfixturevalue(fixture), request.param


@pytest.fixture(scope="module")
def auth_server() -> Iterator[ServerProcess]:
    process = start(*FAST, "--auth-jwt-secret", SECRET)
    yield process
    process.stop()


def path(name: str) -> str:
    return "/v1/stream/" + quote(name, safe="/")


def wait(driver: webdriver.Chrome, seconds: float, condition, message: str):  # type: ignore[no-untyped-def]
    try:
        return WebDriverWait(driver, seconds, poll_frequency=0.05).until(lambda d: condition(d))
    except TimeoutException:
        raise AssertionError(f"{message} (within {seconds} s)") from None


def row(driver: webdriver.Chrome, name: str) -> list:
    return driver.find_elements(By.CSS_SELECTOR, f'#streams tr[data-name="{name}"]')


def script_errors(driver: webdriver.Chrome) -> list[str]:
    """Uncaught exceptions and CSP refusals in the page's console since the last call (failed
    requests the page handles, such as a 401 it shows, are not errors of the page)."""
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and entry["source"] != "network"
    ]


def text_of(driver: webdriver.Chrome, selector: str) -> str:
    found = driver.find_elements(By.CSS_SELECTOR, selector)
    return found[0].text if found else ""


def test_streams_come_and_go_in_the_list_without_a_reload(
    browser: webdriver.Chrome, list_server: tuple[ServerProcess, str]
) -> None:
    server, way = list_server
    base = server.url
    browser.get(f"{base}/ui/")
    expected = "live from __registry__" if way == "registry" else "polling"
    wait(browser, 5, lambda d: expected in text_of(d, "#list-mode"), f"the list is not {way}")
    browser.execute_script("window.notReloaded = true")
    with httpx.Client(base_url=base, timeout=5) as client:
        names = ["ui-list/orders", "ui-list/logs with space", "ui-list/raw"]
        for name, kind in zip(
            names, ["application/json", "text/plain", "application/octet-stream"], strict=True
        ):
            assert client.put(path(name), headers={"Content-Type": kind}).status_code == 201
        for name in names:
            wait(browser, 8, lambda d, name=name: row(d, name), f"{name!r} never appeared in the list")
        cells = row(browser, "ui-list/orders")[0].find_elements(By.TAG_NAME, "td")
        assert "application/json" in cells[1].text and "open" in cells[5].text
        assert client.delete(path("ui-list/raw")).status_code == 204
        wait(browser, 8, lambda d: not row(d, "ui-list/raw"), "a deleted stream stayed in the list")
    assert browser.execute_script("return window.notReloaded") is True  # no reload happened
    filter_box = browser.find_element(By.ID, "filter")
    filter_box.send_keys("ui-list/*")
    assert row(browser, "ui-list/orders") and row(browser, "ui-list/logs with space")
    filter_box.clear()
    filter_box.send_keys("nothing-matches/*")
    wait(browser, 2, lambda d: not row(d, "ui-list/orders"), "the glob filter did not filter")


def test_stream_page_live_tail_append_box_and_delete(
    browser: webdriver.Chrome, open_server: ServerProcess
) -> None:
    base = open_server.url
    name = "ui-page/orders"
    producer = {"Producer-Id": "checkout-7", "Producer-Epoch": "2", "Producer-Seq": "0"}
    with httpx.Client(base_url=base, timeout=5) as client:
        assert client.put(path(name), headers={"Content-Type": "application/json"}).status_code == 201
        appended = client.post(path(name), json={"order": 1}, headers=producer)
        assert appended.status_code in (200, 204)
        browser.get(f"{base}/ui/#/stream/{quote(name, safe='')}")
        wait(browser, 5, lambda d: text_of(d, "#tail-state") == "live", "the live tail never connected")
        assert "checkout-7" in text_of(browser, "#producers")
        sent = time.monotonic()
        assert client.post(path(name), json={"hello": "from http"}).status_code == 204
        wait(
            browser,
            2,
            lambda d: '"hello": "from http"' in text_of(d, "#tail"),
            "the append missed the live tail",
        )
        assert time.monotonic() - sent < 2

        box = browser.find_element(By.ID, "append-body")
        box.send_keys('{"typed": "in the append box"}')
        browser.find_element(By.ID, "append").click()
        wait(
            browser, 3, lambda d: "appended" in text_of(d, "#append-result"), "the append box did not append"
        )
        messages = client.get(path(name), params={"offset": "-1"}).json()
        assert messages == [{"order": 1}, {"hello": "from http"}, {"typed": "in the append box"}]

        browser.find_element(By.ID, "read").click()  # read back from -1
        wait(browser, 3, lambda d: "3 messages" in text_of(d, "#read-note"), "reading back failed")

        browser.find_element(By.ID, "delete").click()
        assert client.head(path(name)).status_code == 200  # nothing happens before the confirmation
        browser.find_element(By.ID, "delete-confirm").click()
        wait(
            browser,
            5,
            lambda d: d.execute_script("return location.hash") in ("", "#/"),
            "no return to the list",
        )
        assert client.head(path(name)).status_code == 404
        wait(browser, 5, lambda d: "loading" not in text_of(d, "#list-mode"), "the list never loaded")
        assert not row(browser, name)


def test_binary_and_text_streams_render_as_hex_and_text(
    browser: webdriver.Chrome, open_server: ServerProcess
) -> None:
    base = open_server.url
    with httpx.Client(base_url=base, timeout=5) as client:
        client.put(path("ui-kinds/raw"), headers={"Content-Type": "application/octet-stream"})
        client.put(path("ui-kinds/log"), headers={"Content-Type": "text/plain"})
        browser.get(f"{base}/ui/#/stream/{quote('ui-kinds/raw', safe='')}")
        wait(browser, 5, lambda d: text_of(d, "#tail-state") == "live", "the live tail never connected")
        client.post(
            path("ui-kinds/raw"), content=b"\x00AB\xff", headers={"Content-Type": "application/octet-stream"}
        )
        wait(browser, 2, lambda d: "00 41 42 ff" in text_of(d, "#tail"), "bytes were not shown as hex")
        browser.get(f"{base}/ui/#/stream/{quote('ui-kinds/log', safe='')}")
        wait(browser, 5, lambda d: text_of(d, "#tail-state") == "live", "the live tail never connected")
        client.post(
            path("ui-kinds/log"), content=b"<b>plain</b> text", headers={"Content-Type": "text/plain"}
        )
        wait(browser, 2, lambda d: "<b>plain</b> text" in text_of(d, "#tail"), "text was not shown as text")


@pytest.mark.parametrize(
    ("content_type", "document"),
    [
        (
            "text/html",
            "<!doctype html><title>stream</title><p id='content'>hello</p><script>{script}</script>",
        ),
        (
            "image/svg+xml",
            "<svg xmlns='http://www.w3.org/2000/svg'><text id='content' y='20'>hello</text>"
            "<script>{script}</script></svg>",
        ),
    ],
)
def test_a_stream_opened_directly_cannot_run_script_in_the_ui_origin(
    browser: webdriver.Chrome, open_server: ServerProcess, content_type: str, document: str
) -> None:
    base = open_server.url
    kind = content_type.split("/")[1].split("+")[0]
    loot = f"ui-loot/{kind}"
    script = (
        "document.title = 'pwned';"
        "try { localStorage.setItem('pwned', '1'); } catch (e) {}"
        "try { document.cookie = 'pwned=1; path=/'; } catch (e) {}"
        f"fetch('{path(loot)}', {{method: 'PUT', headers: {{'Content-Type': 'text/plain'}},"
        "  body: String(sessionStorage.getItem('streamkeep.token'))}).catch(() => {});"
        "fetch('/ui/').then(r => r.text()).then(t => fetch('/v1/stream/ui-loot/ui', {method: 'PUT', body: t}));"
    )
    name = f"ui-evil/{kind}"
    with httpx.Client(base_url=base, timeout=5) as client:
        created = client.put(
            path(name), headers={"Content-Type": content_type}, content=document.format(script=script)
        )
        assert created.status_code == 201
        # The UI's tab holds a token, as a real user's would.
        browser.get(f"{base}/ui/")
        browser.find_element(By.ID, "token").send_keys("secret-token-of-the-ui")
        browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
        assert (
            browser.execute_script("return sessionStorage.getItem('streamkeep.token')")
            == "secret-token-of-the-ui"
        )

        browser.get(f"{base}{path(name)}")  # the stream itself, in the same tab
        wait(browser, 5, lambda d: d.find_elements(By.ID, "content"), "the stream's document did not render")
        time.sleep(0.5)  # what a script would have done, it would have done by now
        assert browser.title != "pwned"
        # Content-Security-Policy: sandbox: the document has an opaque origin, not the UI's.
        assert browser.execute_script("return window.origin") == "null"
        assert client.head(path(loot)).status_code == 404
        assert client.head("/v1/stream/ui-loot/ui").status_code == 404

        browser.get(f"{base}/ui/")
        assert browser.execute_script("return localStorage.getItem('pwned')") is None
        assert "pwned" not in browser.execute_script("return document.cookie")
        assert (
            browser.execute_script("return sessionStorage.getItem('streamkeep.token')")
            == "secret-token-of-the-ui"
        )
        browser.find_element(By.ID, "token-clear").click()


def test_with_auth_on_the_page_without_a_token_shows_401(
    browser: webdriver.Chrome, auth_server: ServerProcess
) -> None:
    base = auth_server.url
    admin = jwt.encode({"sub": "root", "scope": "admin", "exp": int(time.time()) + 600}, SECRET, "HS256")
    with httpx.Client(base_url=base, timeout=5, headers={"Authorization": f"Bearer {admin}"}) as client:
        assert client.put(path("ui-auth/secret"), headers={"Content-Type": "text/plain"}).status_code == 201
    browser.get(f"{base}/ui/")
    wait(browser, 5, lambda d: "401" in text_of(d, "#list-error"), "no 401 shown without a token")
    assert "token" in text_of(browser, "#list-error")
    assert not row(browser, "ui-auth/secret")

    browser.find_element(By.ID, "token").send_keys(admin)
    browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    wait(browser, 8, lambda d: row(d, "ui-auth/secret"), "the token did not open the list")
    assert not browser.find_element(By.ID, "list-error").is_displayed()
    assert admin not in browser.current_url
    browser.get(f"{base}/ui/#/stream/{quote('ui-auth/secret', safe='')}")
    wait(
        browser,
        5,
        lambda d: text_of(d, "#tail-state") == "live",
        "the live tail did not connect with the token",
    )
    browser.find_element(By.ID, "token-clear").click()


def test_screenshots_for_the_docs(
    browser: webdriver.Chrome, open_server: ServerProcess, tmp_path: Path
) -> None:
    """Both pages render with data in them (docs/stream-browser.md's pictures, saved to docs/ with
    STREAMKEEP_SCREENSHOTS=1; elsewhere only checked)."""
    base = open_server.url
    docs = ROOT / "docs" if SCREENSHOTS else tmp_path
    with httpx.Client(base_url=base, timeout=5) as client:
        for name, kind in [
            ("orders/eu", "application/json"),
            ("orders/us", "application/json"),
            ("logs/checkout", "text/plain"),
            ("sensors/raw", "application/octet-stream"),
        ]:
            client.put(path(name), headers={"Content-Type": kind})
        for i in range(40):
            client.post(
                path("orders/eu"),
                json={"order": i, "sku": f"A-{i % 7}", "qty": i % 3 + 1},
                headers={"Producer-Id": "checkout-1", "Producer-Epoch": "0", "Producer-Seq": str(i)},
            )
            client.post(
                path("logs/checkout"),
                content=f"GET /cart 200 {i} ms\n".encode(),
                headers={"Content-Type": "text/plain"},
            )
        client.post(
            path("sensors/raw"),
            content=bytes(range(64)),
            headers={"Content-Type": "application/octet-stream"},
        )
        client.put(
            path("orders/eu-replay"),
            headers={"Content-Type": "application/json", "Stream-Forked-From": path("orders/eu")},
        )
        client.post(path("orders/us"), json={"order": "closed"}, headers={"Stream-Closed": "true"})
        client.put(path("wake/pool"), headers={"Content-Type": "application/json"})
        client.put(
            "/v1/stream/__ds/subscriptions/billing",
            content=json.dumps({"type": "pull-wake", "pattern": "orders/*", "wake_stream": "wake/pool"}),
        )
        browser.get(f"{base}/ui/")
        browser.find_element(By.ID, "token-clear").click()
        wait(browser, 8, lambda d: row(d, "sensors/raw"), "the list did not load")
        _save(browser, docs / "ui-streams.png")
        browser.get(f"{base}/ui/#/stream/{quote('orders/eu', safe='')}")
        wait(browser, 5, lambda d: text_of(d, "#tail-state") == "live", "the live tail never connected")
        browser.find_element(By.ID, "read").click()  # read back from -1
        seq = 40
        with client.stream("GET", path("orders/eu"), params={"offset": "now", "live": "sse"}) as reader:
            for tick in range(56):  # ~28 s: a burst, a lull and a second reader, something to chart
                for _ in range(tick % 9 + (8 if 14 <= tick < 26 else 0)):
                    sent = client.post(
                        path("orders/eu"),
                        json={"order": seq, "sku": f"A-{seq % 7}", "qty": 1},
                        headers={
                            "Producer-Id": "checkout-1",
                            "Producer-Epoch": "0",
                            "Producer-Seq": str(seq),
                        },
                    )
                    assert sent.status_code == 200
                    seq += 1
                time.sleep(0.5)
                if tick == 36:
                    reader.close()
        browser.execute_script("window.scrollTo(0, 0)")
        _save(browser, docs / "ui-stream.png")
    for picture in ("ui-streams.png", "ui-stream.png"):
        data = (docs / picture).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 20_000, (picture, len(data))  # drawn, not blank


def _save(driver: webdriver.Chrome, target: Path) -> None:
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1360, min(max(height, 700), 2400))
    driver.save_screenshot(str(target))
    driver.set_window_size(1360, 1000)
