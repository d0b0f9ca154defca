"""The web dashboard's server half against a stand-in Service: the page and its files, the status stream (a push on
every change, a refresh without one), the plan's reasons, and the key (sign-in form, session cookie, Bearer)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from core.controller.events import EventLog
from core.endpoints.api import serve_api
from core.endpoints.auth import SESSION_COOKIE, session_token
from core.endpoints.dashboard import PUSH_GAP_S, REFRESH_S
from core.errors import PlanError
from core.status import ClusterStatus, CoordinatorState, CoordinatorStatus, NodeState, NodeStatus

KEY = "web-key-0123456789abcdef"


class Stand:
    """The Service as the dashboard uses it: snapshots that a test changes, and the change notification."""

    context = 512

    def __init__(self, plan_problem: str = "") -> None:
        self.node = NodeStatus(name="n0", host="127.0.0.1", kind="local", rpc_port=1, state=NodeState.READY,
                               layers=(0, 3))
        self.plan_problem = plan_problem
        self.log = EventLog(Path("/nonexistent/events.jsonl"))  # the controller's change notification; no file

    def snapshot(self) -> ClusterStatus:
        return ClusterStatus(cluster="lab", model="demo.gguf", nodes=[self.node], n_layers=4,
                             coordinator=CoordinatorStatus(state=CoordinatorState.READY), api_endpoint="127.0.0.1:1",
                             started_at=1_800_000_000.0)

    def serving(self) -> bool:
        return True

    def explain_plan(self) -> list[dict[str, Any]]:
        if self.plan_problem:
            raise PlanError(self.plan_problem)
        return [{"name": "n0", "layers": [0, 3], "share": 1.0, "why": "4 of 4 layers: an equal share"}]

    def change(self, state: NodeState) -> None:
        """As the controller's units do: change, then wake every watcher."""
        self.node.state = state
        self.log.notify()

    async def wait_change(self, timeout: float) -> None:
        await self.log.wait_change(timeout)


Check = Callable[[aiohttp.ClientSession, str], Awaitable[None]]


def served(check: Check, key: str | None = None, service: Stand | None = None) -> None:
    """Run ``check`` against the API app (the dashboard's routes with it) served for ``service``."""
    async def main() -> None:
        server = await serve_api(service or Stand(), "127.0.0.1", 0, key)  # type: ignore[arg-type]
        try:
            async with aiohttp.ClientSession() as session:
                await check(session, f"http://{server.address}")
        finally:
            await server.close()
    asyncio.run(main())


async def snapshots(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """Each server-sent event's snapshot, with when it arrived."""
    async for line in response.content:
        if line.startswith(b"data: "):
            yield time.monotonic(), json.loads(line[len(b"data: "):])


def test_the_page_its_files_and_nothing_else() -> None:
    async def check(session: aiohttp.ClientSession, base: str) -> None:
        async with session.get(f"{base}/dashboard", allow_redirects=False) as response:
            assert response.status == 301 and response.headers["Location"] == "/dashboard/"
        async with session.get(f"{base}/dashboard/") as response:
            page = await response.text()
            assert response.status == 200 and response.content_type == "text/html"
        # Every file the page loads is served here: nothing comes from elsewhere.
        for name in ("static/uPlot.iife.min.js", "static/uPlot.min.css", "static/dashboard.js",
                     "static/dashboard.css"):
            assert f'"{name}"' in page
            async with session.get(f"{base}/dashboard/{name}") as response:
                assert response.status == 200 and len(await response.read()) > 1000
        assert "http" not in page.replace("http-equiv", "")
        for missing in ("static/VENDORED.md", "static/..%2Findex.html", "static/index.html"):
            async with session.get(f"{base}/dashboard/{missing}") as response:
                assert response.status == 404

    served(check)


def test_the_stream_pushes_a_change_at_once_and_refreshes_without_one() -> None:
    service = Stand()

    async def check(session: aiohttp.ClientSession, base: str) -> None:
        async with session.get(f"{base}/dashboard/events") as response:
            assert response.content_type == "text/event-stream"
            stream = snapshots(response)
            first_at, first = await anext(stream)
            assert first == service.snapshot().to_dict()
            assert first["dashboard_url"] == "http://127.0.0.1:1/dashboard/"
            _, refreshed = await anext(stream)  # nothing changed: the refresh, a second later
            assert time.monotonic() - first_at >= REFRESH_S * 0.9 and refreshed["nodes"][0]["state"] == "ready"
            await asyncio.sleep(PUSH_GAP_S)
            changed_at = time.monotonic()
            service.change(NodeState.RESTARTING)
            arrived, pushed = await anext(stream)
            assert pushed["nodes"][0]["state"] == "restarting" and arrived - changed_at < 0.2
            # A burst of changes comes as one snapshot per gap, the last state in it.
            burst_at = time.monotonic()
            for state in (NodeState.STARTING, NodeState.READY):
                service.change(state)
            states = []
            while not states or states[-1] != "ready":
                arrived, pushed = await anext(stream)
                states.append(pushed["nodes"][0]["state"])
            assert arrived - burst_at < 0.5 and len(states) <= 2

    served(check, service=service)


def test_the_plan_and_why_and_a_plan_not_explained_yet() -> None:
    async def rows(session: aiohttp.ClientSession, base: str) -> None:
        async with session.get(f"{base}/dashboard/plan") as response:
            assert await response.json() == {"problem": "", "rows": [
                {"name": "n0", "layers": [0, 3], "share": 1.0, "why": "4 of 4 layers: an equal share"}]}

    async def problem(session: aiohttp.ClientSession, base: str) -> None:
        async with session.get(f"{base}/dashboard/plan") as response:
            assert await response.json() == {"problem": "not measured", "rows": []}

    served(rows)
    served(problem, service=Stand(plan_problem="not measured"))


def test_with_a_key_a_browser_signs_in_once_and_the_cookie_opens_only_the_dashboard() -> None:
    async def check(session: aiohttp.ClientSession, base: str) -> None:
        for path in ("/dashboard/", "/dashboard"):
            async with session.get(f"{base}{path}", allow_redirects=False) as response:
                text = await response.text()
                assert response.status == 401 and 'action="/dashboard/login"' in text and "n0" not in text
        for path in ("/dashboard/events", "/dashboard/plan", "/dashboard/static/dashboard.js"):
            async with session.get(f"{base}{path}") as response:
                assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        async with session.post(f"{base}/dashboard/login", data={"key": "guess-0123456789abcdef"},
                                allow_redirects=False) as response:
            assert response.status == 401 and "not this cluster" in await response.text()
            assert SESSION_COOKIE not in response.cookies
        async with session.post(f"{base}/dashboard/login", data={"key": KEY + "\n"},
                                allow_redirects=False) as response:
            assert response.status == 303 and response.headers["Location"] == "/dashboard/"
            cookie = response.cookies[SESSION_COOKIE]
            assert cookie.value == session_token(KEY) and KEY not in cookie.value
            assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/dashboard/"
        signed_in = {"Cookie": f"{SESSION_COOKIE}={cookie.value}"}
        async with session.get(f"{base}/dashboard/", headers=signed_in) as response:
            assert response.status == 200 and "dashboard.js" in await response.text()
        async with session.get(f"{base}/dashboard/events", headers=signed_in) as response:
            assert response.status == 200
            _, first = await anext(snapshots(response))
            assert first["nodes"][0]["name"] == "n0"
        # The cookie is the dashboard's: the API still needs the key itself.
        async with session.get(f"{base}/v1/models", headers=signed_in) as response:
            assert response.status == 401
        async with session.get(f"{base}/dashboard/plan",
                               headers={"Cookie": f"{SESSION_COOKIE}={session_token('another-key-0123456789')}"}
                               ) as response:
            assert response.status == 401
        async with session.get(f"{base}/dashboard/plan", headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 200

    served(check, key=KEY)


def test_without_a_key_the_dashboard_is_open_and_sign_in_goes_to_it() -> None:
    async def check(session: aiohttp.ClientSession, base: str) -> None:
        async with session.get(f"{base}/dashboard/plan") as response:
            assert response.status == 200
        async with session.post(f"{base}/dashboard/login", data={"key": "x"}, allow_redirects=False) as response:
            assert response.status == 303 and SESSION_COOKIE not in response.cookies

    served(check)


@pytest.mark.parametrize(("endpoint", "url"), [
    ("127.0.0.1:8080", "http://127.0.0.1:8080/dashboard/"), ("::1:8080", "http://[::1]:8080/dashboard/"),
    ("0.0.0.0:9000", "http://0.0.0.0:9000/dashboard/"), ("", "")])
def test_the_dashboard_url_is_on_the_apis_port(endpoint: str, url: str) -> None:
    status = ClusterStatus(cluster="c", model="m", coordinator=CoordinatorStatus(), nodes=[], api_endpoint=endpoint)
    assert status.dashboard_url == url and status.to_dict()["dashboard_url"] == url
    assert ClusterStatus.from_dict(status.to_dict()).dashboard_url == url
