"""A real browser for the web dashboard's tests: Debian's Chromium, headless, through its chromedriver (Selenium),
with the page's console log; and the checks the tests share."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from tests.harness import needs

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WINDOW = (1400, 1000)


def missing() -> str | None:
    """Why there is no browser to test with here (tests/system-deps.sh installs it), or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(path):
            return f"{path} is not installed (Debian: apt-get install chromium chromium-driver; `make test-deps`)"
    return None


def needs_browser() -> None:
    """Skip on a developer machine without Chromium; fail in CI, which installs it."""
    needs(missing())


def chrome() -> webdriver.Chrome:
    """Headless Chromium that keeps the page's console messages (read with `console`)."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # --no-sandbox: the tests run as root (CI), where Chromium's sandbox refuses to start.
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver named outright: Selenium would otherwise look for one to download.
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    # The page's own size exactly (the window's includes the browser's frame): what a screenshot shows.
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": WINDOW[0], "height": WINDOW[1], "deviceScaleFactor": 1, "mobile": False})
    return driver


def console(driver: webdriver.Chrome) -> list[str]:
    """The page's console errors and warnings (failed loads, script errors) since the last call."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]


def wait_for(driver: webdriver.Chrome, script: str, check: Callable[[Any], bool], timeout: float,
             what: str) -> Any:
    """What ``script`` returns in the page, as soon as ``check`` holds for it (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(script)
        if check(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"the page did not show {what} within {timeout:g}s: {value!r}")
        time.sleep(0.05)


NODE_ROWS = """return [...document.querySelectorAll('#nodes tbody tr')].map(row => Object.fromEntries(
    [...row.querySelectorAll('[data-field]')].map(cell => [cell.dataset.field, cell.textContent])))"""
