"""An aiohttp application served on a loopback address from a thread of its own, for the length of
a `with` block: what the fault-injection stand-ins (fault_proxy.py, metrics_stand_in.py) run on.

Their handlers are coroutines, so one that holds a connection open (a trickled answer, a watch
stream passed through) costs no thread; `call` runs a function on the server's event loop from
the test's thread (to cut the streams it holds, say).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from aiohttp import web

from e2e.polling import Background


class AioServer(Background):
    """Serves `app` on http://host:port once the block is entered (ProcessError-free: a port that
    cannot be bound raises OSError from `__enter__`)."""

    def __init__(self, name: str, app: web.Application, host: str, port: int) -> None:
        super().__init__(name)
        self.app, self.host, self.port = app, host, port
        self.url = f"http://{host}:{port}"
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> AioServer:
        super().__enter__()
        self._started.wait(30)
        if self._error is not None:
            self.__exit__()
            raise self._error
        return self

    def loop(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        runner = web.AppRunner(self.app, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port, reuse_address=True).start()
        except OSError as error:
            self._error = error
            self._started.set()
            await runner.cleanup()
            return
        self._started.set()
        try:
            while not self.stopping.is_set():
                await asyncio.sleep(0.1)
        finally:
            await runner.cleanup()

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the server's event loop (thread-safe)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(fn)
