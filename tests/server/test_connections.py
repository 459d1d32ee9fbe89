"""F7: a connection that never finishes its request head is closed; complete requests are served."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from ragkv.server.protocol import header_timeout_protocol
from tests.server.conftest import free_port


async def _hello(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def served_port():
    port = free_port()
    config = uvicorn.Config(_hello, host="127.0.0.1", port=port, http=header_timeout_protocol(0.5),
                            timeout_keep_alive=30, log_level="warning", lifespan="off")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def _response(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"ok"):  # the whole response: status line, headers and its 2-byte body
        data += sock.recv(1024)
    return data


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(20)  # far longer than the 0.5 s header timeout: only a hang reaches it
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False


def test_a_slow_request_head_is_cut_off(served_port):
    with socket.create_connection(("127.0.0.1", served_port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never the blank line
        assert _closed_by_server(sock)


def test_a_kept_alive_connection_must_send_its_next_head_in_time(served_port):
    with socket.create_connection(("127.0.0.1", served_port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET / HTTP/1.1\r\n")  # the second request's head stalls
        assert _closed_by_server(sock)


def test_prompt_requests_are_served(served_port):
    with socket.create_connection(("127.0.0.1", served_port)) as sock:
        for _ in range(2):
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _response(sock).startswith(b"HTTP/1.1 200")


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        header_timeout_protocol(0)
    assert asyncio.Protocol in header_timeout_protocol(1.0).__mro__
