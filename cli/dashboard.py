"""The live `status` screen: a rich Live loop over the controller's snapshot stream."""

from __future__ import annotations

import asyncio

from rich.console import Console
from rich.live import Live
from rich.text import Text

from cli.render import status_view
from core import client
from core.errors import ConnectError
from core.state import StateDir

RECONNECT_S = 1.0


async def live(state: StateDir, console: Console, interval: float = 1.0) -> None:
    """Show the dashboard until Ctrl-C; wait and reconnect while the controller is away."""
    with Live(Text("connecting…"), console=console, refresh_per_second=4, screen=False) as view:
        while True:
            try:
                async for snapshot in client.watch(state, interval):
                    view.update(status_view(snapshot))
            except ConnectError as exc:
                view.update(Text(f"{exc}; retrying…", style="yellow"))
            await asyncio.sleep(RECONNECT_S)
