"""A shared secret on the internal worker gRPC services.

The ingress draws a token when it starts and hands it to the workers it
creates and to the coordinator; a worker answers only calls that carry it
in their metadata (anything else: UNAUTHENTICATED). Workers also listen on
their node's address only, not on every interface. A worker started
without a token (in-process tests, `specserve bench`) checks nothing.
"""

from __future__ import annotations

import hmac

import grpc

TOKEN_KEY = "x-specserve-worker-token"


class RequireToken(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self.token = token

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if hmac.compare_digest(sent.encode(), self.token.encode()):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


class _AddToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self.metadata = ((TOKEN_KEY, token),)

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def worker_channel(address: str, token: str | None = None) -> grpc.Channel:
    """A channel to a worker that sends `token` with every call (None: none)."""
    channel = grpc.insecure_channel(address)
    return grpc.intercept_channel(channel, _AddToken(token)) if token else channel


def server_interceptors(token: str | None) -> list[grpc.ServerInterceptor]:
    return [RequireToken(token)] if token else []
