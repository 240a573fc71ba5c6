"""The live mesh view in a real browser (Debian's headless Chromium, driven by Selenium) against
the compose mesh under load: every endpoint shown, no console error, a slowed server's row shows
its ejection within seconds, and the page reconnects by itself when the control plane restarts.

The screenshot goes to the test's directory, and also to $INFERMESH_SCREENSHOT when set (the
docs/control-plane.md's image was made that way)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

from tests.edge_mesh_support import edge_mesh
from tests.scenarios.harness import ComposeMesh
from tests.support import wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("chromedriver") is None or shutil.which("chromium") is None,
        reason="tools/install.sh installs Debian's chromium and chromium-driver",
    ),
]


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = Options()
    options.binary_location = str(shutil.which("chromium"))
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1440,1000"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver: Selenium Manager never looks for (or downloads) a browser.
    driver = webdriver.Chrome(service=Service(str(shutil.which("chromedriver"))), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


# The page redraws every second, so it is read in one script each time (an element found
# first and read later may already be replaced).
ROWS = """return [...document.querySelectorAll('div[data-pool="classifier"] tr[data-endpoint]')]
  .map(r => [r.dataset.endpoint, r.dataset.state,
             r.querySelector('[data-field="reason"]').textContent]);"""


LABELS = """return [...document.querySelectorAll(
  'div[data-pool="classifier"] tr[data-endpoint] [data-field="labels"]')].map(e => e.textContent)"""


def rows(driver: webdriver.Chrome) -> dict[str, str]:
    """The classifier pool's rows: endpoint -> state, as drawn."""
    return {endpoint: state for endpoint, state, _ in driver.execute_script(ROWS)}


def reason(driver: webdriver.Chrome, endpoint: str) -> str:
    return next(why for e, _, why in driver.execute_script(ROWS) if e == endpoint)


def text(driver: webdriver.Chrome, element_id: str) -> str:
    return str(driver.execute_script(f"return document.getElementById('{element_id}').textContent"))


def console_errors(driver: webdriver.Chrome) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def connection(driver: webdriver.Chrome) -> str:
    return text(driver, "connection")


def test_the_live_view_follows_a_slowed_server_and_a_control_plane_restart(
    demo_repo: Path, tmp_path: Path, browser: webdriver.Chrome
) -> None:
    flags = ("--enable-fault-injection",)
    with ComposeMesh(tmp_path / "mesh", demo_repo, server_flags=flags) as mesh:
        servers = {f"127.0.0.1:{port}": name for name, port in mesh.server_ports.items()}
        with mesh.traffic(clients=4, deadline_s=150) as traffic:
            traffic.wait_ok(100)
            browser.get(f"http://{mesh.admin}/ui")
            wait_for(lambda: set(rows(browser)) == set(servers), 30, "a row per endpoint")
            wait_for(lambda: set(rows(browser).values()) == {"serving"}, 30, "all serving")
            assert connection(browser) == "live"
            assert console_errors(browser) == []
            # Each server found its own device class and reported it; the row shows it.
            cpu = ["device_class=cpu"] * len(servers)
            wait_for(lambda: browser.execute_script(LABELS) == cpu, 20, "each row's labels")

            slow = "model-server-3"
            address = f"127.0.0.1:{mesh.server_ports[slow]}"
            mesh.post_faults(slow, {"latency_ms": 200})
            slowed = time.monotonic()
            wait_for(lambda: rows(browser)[address] == "ejected", 20, "the row to show ejected")
            shown_after = time.monotonic() - slowed
            why = reason(browser, address)
            decisions = text(browser, "decisions")
            browser.save_screenshot(str(tmp_path / "live-view.png"))
            if os.environ.get("INFERMESH_SCREENSHOT"):
                shutil.copy(tmp_path / "live-view.png", os.environ["INFERMESH_SCREENSHOT"])
            mesh.post_faults(slow, {"reset": True})
            # A narrow window: the page reflows (tables scroll inside their card), nothing
            # spills out of the viewport.
            browser.set_window_size(560, 900)
            overflow = "return document.documentElement.scrollWidth - window.innerWidth"
            wait_for(lambda: browser.execute_script(overflow) <= 0, 10, "no sideways overflow")
            browser.save_screenshot(str(tmp_path / "live-view-narrow.png"))

            # The control plane this page reads from dies and comes back: the page follows.
            before = text(browser, "updated")
            os.kill(mesh.pids()["control-plane-1"], signal.SIGKILL)
            wait_for(lambda: connection(browser) == "reconnecting", 20, "the page to notice")
            wait_for(lambda: connection(browser) == "live", 60, "the page to reconnect")
            wait_for(lambda: text(browser, "updated") != before, 20, "new frames")
            wait_for(lambda: set(rows(browser)) == set(servers), 30, "every row back")
            traffic.wait_ok(50)
    print(
        f"\nlive view: {address} shown ejected {shown_after:.1f} s after +200 ms "
        f"({why!r}); reconnected after a control-plane kill -9; {traffic.ok} OK, "
        f"{len(traffic.errors)} failed"
    )
    assert "ejected" in why and f"{address} ejected" in decisions
    assert not traffic.errors, traffic.errors[:5]


def test_with_a_token_the_page_drains_an_endpoint_and_sets_a_split(
    demo_repo: Path, tmp_path: Path, browser: webdriver.Chrome
) -> None:
    # compose.yaml gives both replicas .infermesh/admin.token (the harness makes it)
    with ComposeMesh(tmp_path / "mesh", demo_repo) as mesh:
        token = mesh.env["INFERMESH_ADMIN_TOKEN"]
        servers = {f"127.0.0.1:{port}" for port in mesh.server_ports.values()}
        browser.get(f"http://{mesh.admin}/ui")
        wait_for(lambda: set(rows(browser)) == servers, 30, "a row per endpoint")
        shown = "return !document.getElementById('token-box').hidden"
        wait_for(lambda: browser.execute_script(shown), 10, "the token box")
        browser.execute_script(
            "const input = document.getElementById('token'); input.value = arguments[0];"
            "input.dispatchEvent(new Event('change'));",
            token,
        )
        address = f"127.0.0.1:{mesh.server_ports['model-server-3']}"
        click = "document.querySelector(`tr[data-endpoint='${arguments[0]}'] button`).click()"
        browser.execute_script(click, address)
        wait_for(lambda: rows(browser)[address] == "draining", 20, "the row to show draining")
        endpoint = mesh.admin_get("/status")["endpoints"][address]
        assert endpoint["health_override"] == "DRAINING"
        browser.execute_script(
            "const form = document.querySelector('div[data-pool=\"classifier\"] form');"
            "form.querySelector('input').value = '100'; form.requestSubmit();"
        )
        split = "return document.querySelector('[data-split=\"classifier\"]').textContent"
        wait_for(lambda: "v1 100%" in browser.execute_script(split), 20, "the split shown")
        assert mesh.admin_get("/status")["version_splits"]["classifier"] == {"1": 100}
        assert console_errors(browser) == []


WARNINGS = """const e = document.getElementById('warnings');
return e.hidden ? null : e.textContent;"""


def test_the_page_warns_while_authentication_is_off(
    browser: webdriver.Chrome, demo_repo: Path, tmp_path: Path
) -> None:
    with edge_mesh(demo_repo, tmp_path, {"auth": {"mode": "off"}}) as mesh:
        browser.get(f"http://127.0.0.1:{mesh.plane.plane.admin_port}/ui")
        shown = wait_for(lambda: browser.execute_script(WARNINGS), 30, "the warning banner")
        assert "warning: authentication is off on the public listener" in shown
        assert not console_errors(browser)
