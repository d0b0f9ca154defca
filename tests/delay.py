"""A TCP proxy that holds every chunk for a delay in each direction, in order: link latency where the kernel has no
netem (this one has tbf for rate, nothing for delay). Run it in a network namespace as
``python -m tests.delay LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_MS``."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time

from tests.harness import free_port


class DelayProxy:
    """Listens on ``listen`` and forwards to ``target``, each chunk ``delay`` seconds late each way."""

    def __init__(self, target_port: int, delay: float, *, target_host: str = "127.0.0.1",
                 listen: tuple[str, int] | None = None) -> None:
        self.host, self.port = listen or ("127.0.0.1", free_port())
        self.target = (target_host, target_port)
        self.delay = delay
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(asyncio.start_server(self._serve, self.host, self.port))
        self._started.set()
        self._loop.run_forever()
        # Open connections: end them quietly; ending one may leave a task of its own (a pipe's sender) to end.
        while pending := asyncio.all_tasks(self._loop):
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self.target)
        for writer in (client_writer, server_writer):
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as ggml-rpc sets it
        try:
            await asyncio.gather(self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer),
                                 return_exceptions=True)
        except asyncio.CancelledError:
            pass  # the proxy is closing; end as if the connection had
        finally:
            for writer in (client_writer, server_writer):
                writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    writer.write_eof()
                    return
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(1 << 20):
                queue.put_nowait((time.monotonic() + self.delay, data))
            queue.put_nowait((time.monotonic(), b""))
            await sender
        finally:
            sender.cancel()  # the connection ended early (reset, or the proxy closing): nothing left to deliver


def main(argv: list[str]) -> int:
    """Serve until killed."""
    listen_host, listen_port, target_host, target_port, delay_ms = argv
    with DelayProxy(int(target_port), float(delay_ms) / 1000, target_host=target_host,
                    listen=(listen_host, int(listen_port))):
        threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
