"""The one vLLM utility the tests call directly: a free TCP port on 127.0.0.1."""

import socket


def get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
