"""The HTTP body limit (`AppConfig.max_body_bytes`): an ASGI middleware in front of the routes.

A body over the limit is refused with 413 before it is parsed or tokenized
(a 33.6 MB prompt used to stall every stream for 30 s): by its
Content-Length when it has one, else while it arrives. The rest of a
refused body is read and dropped (up to DRAIN_BYTES, for DRAIN_S at most)
before the response ends: a client that sends its whole body before it
reads (Python's urllib) otherwise meets a connection reset by the unread
bytes instead of its 413. One that asked `Expect: 100-continue` is answered
at once. The limit is set by the ingress replica when it starts (module
state, as in `auth`).
"""

from __future__ import annotations

import asyncio
import json
import time

from specserve.serve.protocol import openai_error

_max_body_bytes = 4 * 1024 * 1024
DRAIN_BYTES, DRAIN_S = 256 * 1024 * 1024, 30.0


def configure(max_body_bytes: int) -> None:
    global _max_body_bytes
    _max_body_bytes = max_body_bytes


def _too_large_body(limit: int) -> bytes:
    return json.dumps(openai_error(f"request body exceeds {limit} bytes (max_body_bytes)", None,
                                   "request_too_large")).encode()


class BodyLimit:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = _max_body_bytes
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length", b"")
        drain = headers.get(b"expect", b"").lower() != b"100-continue"
        if length.isdigit() and int(length) > limit:
            return await self._refuse(send, limit, receive if drain and int(length) <= DRAIN_BYTES else None)
        # Read the body here (at most `limit` bytes are held), then hand it to the app in one piece: an error
        # raised while the app reads it would surface as FastAPI's 400 "error parsing the body".
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._refuse(send, limit, receive if message.get("more_body") else None)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later: disconnect notices, as a streaming response waits for them

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send, limit: int, receive=None) -> None:
        """413; receive: the rest of the body to read and drop before the response ends (None: none)."""
        body = _too_large_body(limit)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        if receive is not None:
            await _drain(receive)
        await send({"type": "http.response.body", "body": body})


async def _drain(receive) -> None:
    """Read and drop what is left of a request body, within DRAIN_BYTES and DRAIN_S."""
    dropped, deadline = 0, time.monotonic() + DRAIN_S
    while dropped <= DRAIN_BYTES:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body"):
            return
