"""What a request's rows depend on besides the engine: their client still being there, and the
server not shutting down.

A request that is generating is watched: a task waits on its ASGI receive channel, and the moment
the client disconnects it puts DISCONNECTED on the request's event queue, so its rows are cancelled
at the engine's next step (however fast tokens arrive). When a shutdown's grace period runs out,
SHUTDOWN goes on every watched queue, so each request ends with an error (an error event then
`[DONE]` for a stream, OpenAI's error body otherwise) instead of being cut off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class _Signal:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


DISCONNECTED = _Signal("DISCONNECTED")
SHUTDOWN = _Signal("SHUTDOWN")


class Lifecycle:
    """One server's drain state and the requests it is generating for (event-loop thread only)."""

    def __init__(self) -> None:
        self.draining = False  # set by the runner on SIGTERM/SIGINT: new requests get 503
        self._queues: set[asyncio.Queue] = set()

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    def watch(self, receive: Callable[[], Awaitable[dict]], queue: asyncio.Queue) -> asyncio.Task:
        """Watch a request whose body has been read: DISCONNECTED goes on queue when its client
        leaves. Cancel the returned task when the request is done."""
        self._queues.add(queue)

        async def wait() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            queue.put_nowait(DISCONNECTED)

        task = asyncio.get_running_loop().create_task(wait())
        task.add_done_callback(lambda _: self._queues.discard(queue))
        return task

    def abort_all(self) -> int:
        """End every watched request (the shutdown grace ran out); the number ended."""
        for q in self._queues:
            q.put_nowait(SHUTDOWN)
        return len(self._queues)
