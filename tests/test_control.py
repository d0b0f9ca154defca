"""The controller's control socket as `up` meets it: the path appears only once it accepts connections (and only
for its user), so a client that sees the file never finds it refusing."""

from __future__ import annotations

import asyncio
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from core.endpoints.control import serve_control


def test_the_socket_appears_only_once_it_listens_and_only_for_its_user(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "control.sock"
    seen_at_listen: list[bool] = []
    listen = socket.socket.listen

    def watched(self: socket.socket, *args: Any) -> None:
        seen_at_listen.append(path.exists())  # bind comes before listen: a file then would refuse connections
        listen(self, *args)

    monkeypatch.setattr(socket.socket, "listen", watched)

    async def serve() -> None:
        server = await serve_control(None, path)  # type: ignore[arg-type]  # no client asks anything here
        try:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            _, writer = await asyncio.open_unix_connection(str(path))
            writer.close()
        finally:
            server.close()

    asyncio.run(serve())
    assert seen_at_listen == [False]
    assert list(tmp_path.iterdir()) == [path]  # nothing left beside it
