"""The optional API key of the public endpoints (`AppConfig.api_key`).

HTTP: `Authorization: Bearer KEY`, checked before the body is read (a
request without it learns nothing, not even a 400), else 401 in OpenAI's
error shape. gRPC: metadata `authorization: Bearer KEY`, else
UNAUTHENTICATED. `/health` stays open for probes.

The key lives in this module, set by the ingress replica when it starts
(one ingress per replica process): Serve ships the ingress class by value,
so state kept in the class's own module would be a copy.
"""

from __future__ import annotations

import hmac

from fastapi import Header

_key: str | None = None
UNAUTHENTICATED_MESSAGE = "missing or invalid API key (Authorization: Bearer KEY)"


class Unauthenticated(Exception):
    """A request without the API key."""


def configure(key: str | None) -> None:
    global _key
    _key = key


def key_matches(authorization: str | None) -> bool:
    """Whether an `Authorization` value (HTTP header or gRPC metadata) is `Bearer <key>` (anything, if no key)."""
    if not _key:
        return True
    scheme, _, sent = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), _key.encode())


async def require_key(authorization: str | None = Header(None)) -> None:
    """FastAPI dependency of the /v1 routes."""
    if not key_matches(authorization):
        raise Unauthenticated()
