"""The web dashboard: one page, its static files (uPlot, vendored from npm) and a stream of the cluster's status as
server-sent events, served on the OpenAI-compatible API's port by the API's own aiohttp app.

The stream carries what `status --watch --json` carries, a snapshot per message: one as soon as anything changes
(at most one per ``PUSH_GAP_S``, so a burst of tokens is not a burst of snapshots), and one per ``REFRESH_S``
when nothing does, so rates and charts move. With an API key, a browser signs in once with a form and gets a
session cookie (a page and an EventSource cannot send an ``Authorization`` header); curl may send the Bearer token.
"""

from __future__ import annotations

import asyncio
import html
import json
from importlib import resources

from aiohttp import web

from core.endpoints.auth import SESSION_COOKIE, bearer_matches, session_matches, session_token
from core.errors import ClusterError
from core.service import Service
from core.status import DASHBOARD_PATH

PUSH_GAP_S = 0.1   # at most ten snapshots a second per page: decode steps would otherwise each be one
REFRESH_S = 1.0    # a snapshot at least this often, for the rates and the charts
LOGIN_PATH = f"{DASHBOARD_PATH}login"
# The files the page loads, by name: nothing else under web/ is served, and nothing is fetched from elsewhere.
STATIC = {
    "dashboard.js": "text/javascript", "dashboard.css": "text/css",
    "uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css",
}


def _web_file(name: str) -> bytes:
    return (resources.files("core.endpoints") / "web" / name).read_bytes()


class Dashboard:
    """The dashboard's routes over a Service; ``key``: the API key that guards them (None: open, on loopback)."""

    def __init__(self, service: Service, key: str | None) -> None:
        self.service = service
        self.key = key
        self.page = _web_file("index.html")
        self.login_form = _web_file("login.html").decode()
        self.files = {name: _web_file(name) for name in STATIC}

    def routes(self) -> list[web.RouteDef]:
        """Every route the dashboard answers, under DASHBOARD_PATH."""
        return [
            web.get(DASHBOARD_PATH.rstrip("/"), self.to_page), web.get(DASHBOARD_PATH, self.show_page),
            web.get(f"{DASHBOARD_PATH}static/{{name}}", self.show_file),
            web.get(f"{DASHBOARD_PATH}events", self.stream), web.get(f"{DASHBOARD_PATH}plan", self.show_plan),
            web.post(LOGIN_PATH, self.sign_in),
        ]

    # --- the key -----------------------------------------------------------------------------------

    @staticmethod
    def owns(request: web.Request) -> bool:
        """Whether a request is the dashboard's (its own rules for a missing key)."""
        return request.path.startswith(DASHBOARD_PATH.rstrip("/"))

    def admits(self, request: web.Request) -> bool:
        """Whether a dashboard request may through: no key, the sign-in form itself, the session cookie or the
        Bearer token. The cookie counts only here, never on the API: a page on another site cannot spend it."""
        if self.key is None or request.path == LOGIN_PATH:
            return True
        return session_matches(request.cookies.get(SESSION_COOKIE, ""), self.key) or \
            bearer_matches(request.headers.get("Authorization", ""), self.key)

    def refuse(self, request: web.Request) -> web.Response:
        """401 for a dashboard request without the key: the sign-in form for a page, a line for the rest."""
        if request.method == "GET" and request.path in (DASHBOARD_PATH, DASHBOARD_PATH.rstrip("/")):
            return self._login_page("", 401)
        return web.Response(status=401, text="the dashboard needs the API key: sign in at " + DASHBOARD_PATH,
                            headers={"WWW-Authenticate": "Bearer"})

    def _login_page(self, problem: str, status: int) -> web.Response:
        body = self.login_form.replace("<!--problem-->", html.escape(problem))
        return web.Response(status=status, text=body, content_type="text/html",
                            headers={"WWW-Authenticate": "Bearer", "Cache-Control": "no-store"})

    async def sign_in(self, request: web.Request) -> web.Response:
        """The sign-in form's POST: the right key sets the session cookie and goes to the page."""
        if self.key is None:
            raise web.HTTPSeeOther(DASHBOARD_PATH)
        offered = str((await request.post()).get("key", "")).strip()
        if not bearer_matches(f"Bearer {offered}", self.key):
            return self._login_page("That is not this cluster's API key.", 401)
        answer = web.HTTPSeeOther(DASHBOARD_PATH)
        # HttpOnly: no script reads it; SameSite=Strict: no other site's page sends it; Path: the dashboard only.
        answer.set_cookie(SESSION_COOKIE, session_token(self.key), path=DASHBOARD_PATH, httponly=True,
                          samesite="Strict")
        raise answer

    # --- the page ----------------------------------------------------------------------------------

    async def to_page(self, _: web.Request) -> web.Response:
        """The page's address ends in a slash, so that its relative links (static/, events) resolve under it."""
        raise web.HTTPMovedPermanently(DASHBOARD_PATH)

    async def show_page(self, _: web.Request) -> web.Response:
        """The page."""
        return web.Response(body=self.page, content_type="text/html", headers={"Cache-Control": "no-cache"})

    async def show_file(self, request: web.Request) -> web.Response:
        """One of the page's static files."""
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        return web.Response(body=self.files[name], content_type=STATIC[name], headers={"Cache-Control": "no-cache"})

    async def show_plan(self, _: web.Request) -> web.Response:
        """Why each node got its part of the plan (`plan --json`'s rows); the page asks when the plan changes."""
        try:
            return web.json_response({"rows": self.service.explain_plan(), "problem": ""})
        except ClusterError as exc:  # not measured yet, or no node can serve: the page says so
            return web.json_response({"rows": [], "problem": str(exc)})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: a status snapshot per message, pushed on every change and once a second."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        changed: asyncio.Future[None] | None = None
        try:
            while self.service.serving():
                # Wait for changes from before the snapshot on: one that came while the last was being written
                # would otherwise wait for the next change or the refresh (up to a second late on the page).
                changed = asyncio.ensure_future(self.service.wait_change(REFRESH_S))
                await asyncio.sleep(0)  # the waiter's first step runs now, and from then on a change wakes it
                sent = loop.time()
                await response.write(f"data: {json.dumps(self.service.snapshot().to_dict())}\n\n".encode())
                await changed
                await asyncio.sleep(max(0.0, sent + PUSH_GAP_S - loop.time()))
        except ConnectionError:  # the page was closed
            pass
        finally:
            if changed is not None:
                changed.cancel()
        return response
