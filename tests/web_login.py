"""A browser's view of a dashboard that needs the API key, run where the dashboard is reachable (the beyond-loopback
test runs it in the cluster's network namespace): `python -m tests.web_login URL KEY` prints what it saw as JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

from selenium.webdriver.common.by import By

from tests.browser import NODE_ROWS, chrome, console, wait_for

STATUS_OF = "return fetch(arguments[0]).then(answer => answer.status)"  # a request from the page, with its cookies
FORM = "return document.querySelector('form[action=\"/dashboard/login\"]') !== null"


def sign_in(driver: Any, key: str) -> None:
    field = driver.find_element(By.NAME, "key")
    field.clear()
    field.send_keys(key)
    field.submit()


def main(url: str, key: str) -> dict[str, Any]:
    """What a browser sees without the key, with a wrong one, and signed in."""
    driver = chrome()
    try:
        driver.get(url)
        seen: dict[str, Any] = {"without_key": {
            "form": driver.execute_script(FORM), "nodes": driver.execute_script(NODE_ROWS),
            "stream": driver.execute_script(STATUS_OF, f"{url}events"),
            "plan": driver.execute_script(STATUS_OF, f"{url}plan")}}
        sign_in(driver, "not-the-key-0123456789")
        problem = wait_for(driver, "return document.getElementById('problem')?.textContent", bool, 10, "a problem")
        seen["wrong_key"] = {"form": driver.execute_script(FORM), "problem": problem,
                             "nodes": driver.execute_script(NODE_ROWS)}
        console(driver)  # the refusals above are logged as failed loads: expected, and cleared here
        sign_in(driver, key)
        shown = wait_for(driver, NODE_ROWS, lambda rows: len(rows) == 2 and all(row["state"] for row in rows), 20,
                         "the nodes")
        api = url.removesuffix("/dashboard/") + "/v1/models"
        seen["with_key"] = {
            "nodes": [row["name"] for row in shown], "states": [row["state"] for row in shown],
            "cookie_readable": "ggml_cluster_session" in driver.execute_script("return document.cookie"),
            "errors": console(driver), "api_with_cookie": driver.execute_script(STATUS_OF, api)}
        return seen
    finally:
        driver.quit()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
