"""``--allow-image-url-fetch`` end to end: a real ``tidal serve`` (tiny K3 checkpoint with a vision
tower) fetches ``image_url`` parts from a real HTTP server on 127.0.0.1 run by this test. A
fetched image is the same input as its data: URL (also behind a redirect); too large a body
(declared or not), a server too slow in total or stalling, bad content, HTTP errors, redirect
loops and redirects off http(s) are 400s naming the problem, within the time limit."""

from __future__ import annotations

import atexit
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from live_server import MODEL, Server, start_server
from test_vision_server import data_url, png, write_checkpoint

FETCH_TIMEOUT = 1.0
MAX_BYTES = 100_000
IMAGE = png(11)
assert len(IMAGE) < MAX_BYTES


class Images(BaseHTTPRequestHandler):
    """The routes the tests fetch (HTTP/1.0: a body without Content-Length runs to the close)."""

    def log_message(self, *args) -> None:
        pass

    def send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
             length: bool = True) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        try:
            self.route()
        except (BrokenPipeError, ConnectionResetError):  # the fetcher gave up: what the tests want
            pass

    def route(self) -> None:
        path = self.path
        if path == "/cat.png":
            self.send(200, IMAGE, {"Content-Type": "image/png"})
        elif path == "/big.png":  # refused on its Content-Length
            self.send(200, b"\x89PNG" + bytes(MAX_BYTES), {"Content-Type": "image/png"})
        elif path == "/big-undeclared.png":  # no Content-Length: refused while reading
            self.send(200, b"\x89PNG" + bytes(MAX_BYTES), {"Content-Type": "image/png"}, length=False)
        elif path == "/trickle.png":  # every read is quick, the whole is far too slow
            self.send_response(200)
            self.send_header("Content-Length", str(len(IMAGE)))
            self.end_headers()
            for i in range(0, len(IMAGE), 64):
                self.wfile.write(IMAGE[i:i + 64])
                self.wfile.flush()
                time.sleep(0.1)
        elif path == "/stall.png":
            time.sleep(4 * FETCH_TIMEOUT)
            self.send(200, IMAGE)
        elif path == "/text":
            self.send(200, b"<html>not a picture</html>", {"Content-Type": "text/html"})
        elif path == "/redirect":
            self.send(302, headers={"Location": "/hop"})
        elif path == "/hop":
            self.send(301, headers={"Location": "/cat.png"})
        elif path == "/loop":
            self.send(302, headers={"Location": "/loop"})
        elif path == "/to-ftp":
            self.send(302, headers={"Location": "ftp://127.0.0.1/cat.png"})
        else:
            self.send(404, b"no such image")


@pytest.fixture(scope="module")
def images():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def fetching_server(tmp_path_factory) -> Server:
    ckpt = tmp_path_factory.mktemp("fetch-ckpt")
    write_checkpoint(ckpt)
    server = start_server(str(ckpt), "--allow-image-url-fetch", "--image-fetch-timeout", str(FETCH_TIMEOUT),
                          "--max-image-bytes", str(MAX_BYTES))
    atexit.register(server.stop)
    yield server
    server.stop()


def ask(server: Server, url: str) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def top(r: httpx.Response) -> tuple:
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]["logprobs"]["content"][0]
    return r.json()["usage"]["prompt_tokens"], [(t["token"], round(t["logprob"], 5)) for t in c["top_logprobs"]]


def test_fetched_image_is_the_data_url_image(fetching_server, images):
    inline = top(ask(fetching_server, data_url(IMAGE)))
    assert top(ask(fetching_server, f"{images}/cat.png")) == inline
    assert top(ask(fetching_server, f"{images}/redirect")) == inline  # two redirects, followed
    assert top(ask(fetching_server, data_url(png(12)))) != inline  # another image is another input


@pytest.mark.parametrize("path, message", [
    ("/big.png", f"larger than {MAX_BYTES} bytes \\(--max-image-bytes\\)"),
    ("/big-undeclared.png", f"larger than {MAX_BYTES} bytes"),
    ("/trickle.png", f"took longer than {FETCH_TIMEOUT:g} s \\(--image-fetch-timeout\\)"),
    ("/stall.png", f"took longer than {FETCH_TIMEOUT:g} s"),
    ("/text", "not an image in a supported format"),
    ("/missing.png", "gave HTTP 404"),
    ("/loop", "redirects more than 5 times"),
    ("/to-ftp", "cannot be fetched \\(UnsupportedProtocol"),
])
def test_bad_fetches_are_400s_within_the_time_limit(fetching_server, images, path, message):
    t0 = time.monotonic()
    r = ask(fetching_server, images + path)
    elapsed = time.monotonic() - t0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert __import__("re").search(message, err["message"]), err
    assert err["message"].startswith("image 1 of 1: ")
    # One read may take the whole timeout after the total deadline has nearly passed.
    assert elapsed < 2 * FETCH_TIMEOUT + 1.5, elapsed
    assert httpx.get(f"{fetching_server.url}/health").status_code == 200


def test_unreachable_host_is_a_400(fetching_server):
    from live_server import free_port

    r = ask(fetching_server, f"http://127.0.0.1:{free_port()}/cat.png")
    assert r.status_code == 400 and "cannot be fetched (ConnectError" in r.json()["error"]["message"], r.text
