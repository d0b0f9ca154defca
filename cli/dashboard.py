"""The live `status` screen: a rich Live loop over the controller's snapshot stream."""

from __future__ import annotations

import asyncio

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from cli.render import status_view
from core import client
from core.errors import ConnectError
from core.state import StateDir

RECONNECT_S = 1.0


async def live(state: StateDir, console: Console, interval: float = 1.0) -> None:
    """Show the dashboard until Ctrl-C; while the controller is away, say so and reconnect.

    The alternate screen keeps the dashboard off the scrollback, and Live redraws in place (no flicker).
    Between snapshots it refreshes once a second, so the uptime keeps moving.
    """
    last: RenderableType | None = None
    with Live(Text("connecting…"), console=console, refresh_per_second=4, screen=True,
              redirect_stdout=False, redirect_stderr=False) as view:
        while True:
            try:
                async for snapshot in client.watch(state, interval):
                    last = status_view(snapshot)
                    view.update(last)
                problem = "the controller went away"
            except (ConnectError, ConnectionError) as exc:
                problem = str(exc)
            notice = Text(f"{problem}; reconnecting…", style="bold yellow")
            view.update(Group(notice, last) if last is not None else notice)
            await asyncio.sleep(RECONNECT_S)
