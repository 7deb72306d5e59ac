"""The load bench's client (`specserve.bench.load`) against a real HTTP server that drops connections."""

import asyncio
import http.server
import json
import threading

import pytest

from specserve.bench import load


class _Server(http.server.ThreadingHTTPServer):
    """An OpenAI-style chat server (two streamed tokens an answer) that closes the connection of the chat
    requests `drop` names (by their order of arrival, from 0) without answering."""

    daemon_threads = True

    def __init__(self, drop):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.drop, self.chats = drop, 0


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                            "owned_by": "t"}]}).encode(), "application/json")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        n, self.server.chats = self.server.chats, self.server.chats + 1
        if self.server.drop(n):
            self.close_connection = True  # no status line: the client sees the connection end
            return
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        events = [dict(chunk, choices=[{"index": 0, "delta": {"content": t}, "finish_reason": None}])
                  for t in ("a", "b")]
        events.append(dict(chunk, choices=[], usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}))
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._send(body.encode(), "text/event-stream")


@pytest.fixture
def serve():
    servers = []

    def start(drop):
        server = _Server(drop)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}/v1"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_request_whose_connection_ends_unanswered_is_sent_once_more(serve):
    server, url = serve(lambda n: n == 0)
    row = asyncio.run(load._level(url, 1, 3, 8, None, ["say a and b"]))
    assert (row["requests"], row["errors"], row["retried"], row["tokens"]) == (3, 0, 1, 6)
    assert server.chats == 4


def test_a_request_dropped_twice_is_an_error_and_the_level_goes_on(serve):
    server, url = serve(lambda n: n < 2)
    row = asyncio.run(load._level(url, 1, 2, 8, None, ["say a and b"]))
    assert (row["requests"], row["errors"], row["retried"]) == (1, 1, 0)
    assert "APIConnectionError" in row["error_samples"][0]
    assert server.chats == 3
