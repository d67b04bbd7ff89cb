"""The SSE response of a completion stream: sse-starlette's, less a cancel scope per send."""

from __future__ import annotations

from sse_starlette import EventSourceResponse
from starlette.types import Message, Send


class SseResponse(EventSourceResponse):
    """sse-starlette's EventSourceResponse, sending each message straight to the server when no send
    timeout is set.

    sse-starlette sends every event and ping inside a cancel scope of its own, there to enforce
    `send_timeout`; with no timeout the scope never fires, yet opening one per send is a good part of an
    ingress's CPU with a thousand streams open. All else is sse-starlette's: the headers, the keep-alive
    pings, the end of the stream (its body closed, so its `finally` runs) when the client disconnects or
    the server shuts down, and the timeout when one is set."""

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if self.send_timeout is not None:
            await super()._send_with_timeout(send, message)
            return
        try:
            await send(message)
        except BaseException:
            self._send_interrupted = True  # as sse-starlette marks it: no closing send is tried after it
            raise
