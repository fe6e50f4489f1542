"""The chat page at ``/`` in a real headless Chromium (Debian's ``chromium``, driven by Playwright's
Python package pointed at the system browser; ``scripts/test.sh`` installs it with apt-get).

Two servers: the live ``tidal serve`` of test_server.py (with ``--api-key``) for a real
conversation, a stop mid-stream and the screenshot; and a small HTTP server in this file that
serves the page's own files next to recorded SSE streams (hostile Markdown and HTML, UTF-8 split
mid-character, an error event, a connection cut before ``[DONE]``) and records what the page
sent. That server leaves out the page's Content-Security-Policy, so the escaping checks test the
renderer itself, not the CSP behind it.

Screenshots are kept in ``tests/artifacts/`` (git-ignored).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from live_server import start_server
from test_server import API_KEY, MODEL, metric, shared_server

from tidal.serve.ui import PAGES, asset

ARTIFACTS = Path(__file__).parent / "artifacts"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    found = os.environ.get("TIDAL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    return found if found and os.access(found, os.X_OK) else None


@pytest.fixture(scope="module")
def browser():
    """A fresh Chromium profile for this module; skipped (saying why) only where there is none."""
    exe = chromium_path()
    if exe is None:
        pytest.skip("no Chromium: Debian's `chromium` package is not installed and scripts/test.sh could not "
                    "install it (apt-get install -y chromium); the chat page browser tests need it")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the `playwright` Python package is missing (pip install -e '.[test]')")
    profile = tempfile.mkdtemp(prefix="tidal-chromium-")
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=exe, headless=True, args=CHROMIUM_FLAGS, viewport={"width": 1200, "height": 820})
        try:
            yield ctx
        finally:
            ctx.close()
            shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser):
    pg = browser.new_page()
    pg.errors = []  # uncaught exceptions in the page: every test asserts there are none
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.on("console", lambda m: "Content Security Policy" in m.text and pg.errors.append(m.text))
    pg.set_default_timeout(30_000)
    yield pg
    pg.close()


def screenshot(pg, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    pg.screenshot(path=str(path))
    assert path.stat().st_size > 10_000
    return path


def send(pg, text: str) -> None:
    pg.fill("#prompt", text)
    pg.press("#prompt", "Enter")


def show_settings(pg, shown: bool = True) -> None:
    if pg.is_visible("#settings") != shown:
        pg.click("#toggle-settings")


def last_reply(pg):
    return pg.locator(".msg.assistant").last


def wait_idle(pg) -> None:
    pg.wait_for_function("() => !document.body.classList.contains('busy')")


# ---- against the live server -------------------------------------------------------------------------

def test_page_routes_public_with_api_key_and_no_ui():
    srv = shared_server()
    for path in PAGES:  # no key needed for the page itself
        r = httpx.get(srv.url + path, timeout=10)
        assert r.status_code == 200 and r.content == asset(PAGES[path][0]), path
        assert "script-src 'self'" in r.headers["content-security-policy"]
    assert httpx.get(srv.url + "/").headers["content-type"].startswith("text/html")
    assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 401  # the API still is not public
    off = start_server("--no-ui")
    try:
        for path in PAGES:
            assert httpx.get(off.url + path, timeout=10).status_code == 404, path
        assert httpx.get(off.url + "/v1/models", timeout=10).status_code == 200
    finally:
        off.stop()


def test_conversation_reasoning_cached_tokens_and_stop(page):
    """A real conversation: the key is asked for and sent; text streams into a reasoning block and
    a reply; the second turn re-sends the first (with its reasoning) and hits the prefix cache;
    Stop mid-stream aborts the fetch and the server's running count returns to 0."""
    srv = shared_server()
    page.goto(srv.url + "/")
    page.wait_for_selector("#notice:not([hidden])")
    assert "API key" in page.text_content("#notice")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function(f"() => document.getElementById('model-name').textContent === {json.dumps(MODEL)}")

    page.select_option("#effort", "low")
    page.fill("#temperature", "0")
    send(page, "Write a python function that adds two numbers.")
    reply = last_reply(page)
    reply.locator(".reasoning-body").wait_for(state="attached")
    wait_idle(page)
    assert reply.locator(".reasoning-body").text_content().strip()  # thinking is on: a reasoning block
    meta = reply.locator(".turn-meta").inner_text()
    assert "TTFT" in meta and "tok/s" in meta and "finish:" in meta, meta
    assert not reply.locator(".turn-error").count()

    send(page, "Thanks. And in C?")
    page.wait_for_function("() => document.querySelectorAll('.msg.assistant').length === 2")
    wait_idle(page)
    cached = page.text_content("#stat-cached")
    hit, total = (int(x) for x in cached.split()[1::2])
    assert 0 < hit < total, cached  # the first turn came back from the prefix cache

    # A long reply (ignore_eos through the extra fields), stopped while it streams.
    show_settings(page)
    page.fill("#max-tokens", "4000")
    page.fill("#extra", '{"ignore_eos": true}')
    show_settings(page, False)
    send(page, "Tell me a very long story.")
    streaming = page.locator(".msg.assistant.streaming")
    streaming.wait_for()
    page.wait_for_function("() => (document.querySelector('.msg.assistant.streaming .reasoning-body') || {})"
                           ".textContent?.length > 20")
    first = len(streaming.text_content())
    page.wait_for_function(f"() => document.querySelector('.msg.assistant.streaming').textContent.length > {first}")
    assert metric(srv, "tidal:num_requests_running") == 1
    page.click("#stop")
    wait_idle(page)
    deadline = time.monotonic() + 10
    while metric(srv, "tidal:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the stopped request is still running on the server"
        time.sleep(0.1)
    assert "stopped" in last_reply(page).locator(".turn-meta").inner_text()
    page.wait_for_function("() => document.getElementById('stat-pool').dataset.running === '0'", timeout=10_000)
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    screenshot(page, "chat_page.png")
    assert page.errors == []


# ---- recorded streams ---------------------------------------------------------------------------------

HOSTILE = (
    "Hello <script>window.__pwned = 1</script> and **bold** and `<b>code</b>`.\n"
    "[click me](javascript:window.__pwned=2) [also](JaVaScRiPt:window.__pwned=5) [ok](https://example.com/a?b=1)\n"
    '<img src=x onerror="window.__pwned=3"> ![pic](javascript:window.__pwned=6) <a href="javascript:x">raw</a>\n'
    "```html\n<script>window.__pwned = 4</script>\n```\n"
    "Unicode: naïve 日本語 🌊 done."
)


def chunk(delta: dict | None, *, finish: str | None = None, usage: dict | None = None) -> bytes:
    body = {"id": "chatcmpl-rec", "object": "chat.completion.chunk", "created": 0, "model": "recorded",
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}],
            "usage": usage}
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


def split_mid_utf8(data: bytes) -> list[bytes]:
    """``data`` cut right after the first byte of every multi-byte character."""
    pieces, start = [], 0
    for i, b in enumerate(data):
        if b >= 0xC0:
            pieces.append(data[start:i + 1])
            start = i + 1
    return [*pieces, data[start:]]


def hostile_stream() -> list[bytes]:
    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"reasoning_content": "think <img src=x onerror=\"window.__pwned=7\"> é"})]
    text = HOSTILE
    out += [chunk({"content": text[i:i + 17]}) for i in range(0, len(text), 17)]
    out += [chunk({"tool_calls": [{"index": 0, "id": "call-1", "type": "function",
                                   "function": {"name": "<b>get_weather</b>", "arguments": ""}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "<script>x</script>'}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' Zürich"}'}}]}, finish="tool_calls"),
            chunk(None, usage={"prompt_tokens": 50, "completion_tokens": 40, "total_tokens": 90,
                               "prompt_tokens_details": {"cached_tokens": 32}}),
            b"data: [DONE]\n\n"]
    return [p for piece in out for p in split_mid_utf8(piece)]


STREAMS = {
    "hostile": (hostile_stream, True),
    "error": (lambda: [chunk({"role": "assistant", "content": ""}), chunk({"content": "partial answer"}),
                       b'data: {"error": {"message": "the engine stopped: boom", "type": "service_unavailable", '
                       b'"param": null, "code": 503}}\n\n', b"data: [DONE]\n\n"], True),
    "cut": (lambda: [chunk({"role": "assistant", "content": ""}), chunk({"content": "half a repl"})], False),
}


class Recorded(BaseHTTPRequestHandler):
    """The page's files (without the CSP), /v1/models, /metrics, and the stream named by
    ``server.next_stream``; POST bodies and headers are kept in ``server.requests``."""

    protocol_version = "HTTP/1.0"  # the body ends when the connection closes: "cut" is a disconnect

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path in PAGES:
            name, media_type = PAGES[self.path]
            self._send(200, asset(name), media_type)
        elif self.path == "/v1/models":
            self._send(200, b'{"object": "list", "data": [{"id": "recorded", "object": "model"}]}', "application/json")
        elif self.path == "/metrics":
            self._send(200, b'tidal:pool_usage_perc{model_name="recorded"} 0.25\n'
                            b'tidal:kv_cache_usage_perc{model_name="recorded"} 0.125\n'
                            b'tidal:num_requests_running{model_name="recorded"} 1.0\n'
                            b'tidal:num_requests_waiting{model_name="recorded"} 2.0\n', "text/plain")
        else:
            self._send(404, b"{}", "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((dict(self.headers), body))
        make, complete = STREAMS[self.server.next_stream]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for piece in make():
            self.wfile.write(piece)
            self.wfile.flush()
            time.sleep(0.002)
        if not complete:
            time.sleep(0.2)
        self.close_connection = True


@pytest.fixture(scope="module")
def recorded():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorded)
    httpd.requests, httpd.next_stream = [], "hostile"
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

# Every element and attribute the reply holds, for the injection checks.
DOM_OF_REPLY = """(el) => [...el.querySelectorAll('*')].map(e => ({
    tag: e.tagName.toLowerCase(), attrs: [...e.attributes].map(a => [a.name, a.value])}))"""


def test_hostile_output_renders_as_text(page, recorded):
    """Model output with <script>, <img onerror>, javascript: links: nothing runs, no element or
    attribute comes from the model's markup, only the https link is a link; UTF-8 cut mid-character
    arrives whole; the request carries the settings and the key."""
    url = f"http://127.0.0.1:{recorded.server_address[1]}"
    recorded.next_stream = "hostile"
    page.goto(url + "/chat")
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'recorded'")
    show_settings(page)
    page.fill("#api-key", "sk-page")
    page.select_option("#effort", "max")
    page.fill("#temperature", "0.7")
    page.fill("#max-tokens", "321")
    page.fill("#tools", json.dumps(TOOLS))
    page.fill("#system", "Be brief.")
    send(page, "hi <script>")
    wait_idle(page)
    reply = last_reply(page)
    assert page.evaluate("window.__pwned") is None
    nodes = reply.evaluate(DOM_OF_REPLY)
    tags = {n["tag"] for n in nodes}
    assert not tags & {"script", "img", "iframe", "object", "embed", "svg", "b"}, tags
    for n in nodes:
        for name, value in n["attrs"]:
            assert not name.startswith("on"), n
            assert "javascript" not in value.lower(), n
    hrefs = reply.evaluate("(el) => [...el.querySelectorAll('a')].map(a => [a.textContent, a.getAttribute('href')])")
    assert hrefs == [["ok", "https://example.com/a?b=1"]]
    assert reply.locator("strong").inner_text() == "bold"
    text = reply.locator(".content").inner_text()
    for literal in ("<script>window.__pwned = 1</script>", "[click me](javascript:window.__pwned=2)",
                    '<img src=x onerror="window.__pwned=3">', "![pic](javascript:window.__pwned=6)",
                    "naïve 日本語 🌊 done."):
        assert literal in text, literal
    assert "\ufffd" not in text
    assert reply.locator(".code code").inner_text() == "<script>window.__pwned = 4</script>"
    assert reply.locator(".content code").first.inner_text() == "<b>code</b>"
    assert 'onerror="window.__pwned=7"> é' in reply.locator(".reasoning-body").text_content()
    assert reply.locator(".tool-name").inner_text() == "<b>get_weather</b>"
    args = json.loads(reply.locator(".tool-args").inner_text())
    assert args == {"city": "<script>x</script> Zürich"}
    assert "finish: tool_calls" in reply.locator(".turn-meta").inner_text()
    assert page.text_content("#stat-cached") == "cached 32 / 50"
    page.wait_for_function("() => document.getElementById('stat-pool').textContent.includes('pool 25.0%')")
    assert "running 1 · waiting 2" in page.text_content("#stat-pool")

    headers, body = recorded.requests[-1]
    assert headers["Authorization"] == "Bearer sk-page"
    assert body["model"] == "recorded" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert (body["reasoning_effort"], body["temperature"], body["max_tokens"]) == ("max", 0.7, 321)
    assert body["tools"] == TOOLS
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <script>"}]

    # The reply's tool call goes back with a result; the next request carries the whole history.
    recorded.next_stream = "error"
    reply.locator(".tool-result textarea").fill("sunny")
    reply.locator(".tool-result button").click()
    wait_idle(page)
    _, body = recorded.requests[-1]
    assistant, tool = body["messages"][2:]
    assert assistant["content"] == HOSTILE and assistant["reasoning_content"].startswith("think <img")
    assert assistant["tool_calls"] == [{"id": "call-1", "type": "function", "function": {
        "name": "<b>get_weather</b>", "arguments": '{"city": "<script>x</script> Zürich"}'}}]
    assert tool == {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}
    screenshot(page, "chat_page_escaping.png")
    assert page.errors == []


def test_error_event_and_cut_stream(page, recorded):
    """A stream ending with an error event shows the error beside the text so far; a connection
    closed before [DONE] says so; the page stays usable after both."""
    url = f"http://127.0.0.1:{recorded.server_address[1]}"
    page.goto(url + "/")
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'recorded'")
    for stream, text, error in (("error", "partial answer", "the engine stopped: boom"),
                                ("cut", "half a repl", "closed before the reply finished")):
        recorded.next_stream = stream
        send(page, stream)
        wait_idle(page)
        reply = last_reply(page)
        assert reply.locator(".content").inner_text() == text
        assert error in reply.locator(".turn-error").inner_text()

    recorded.next_stream = "hostile"
    send(page, "three")
    wait_idle(page)
    assert "naïve 日本語 🌊 done." in last_reply(page).locator(".content").inner_text()
    assert not last_reply(page).locator(".turn-error").count()
    assert page.errors == []


def test_markdown_links_keep_only_web_urls(page, recorded):
    """The renderer alone, on link forms that try to smuggle a scheme."""
    page.goto(f"http://127.0.0.1:{recorded.server_address[1]}/")
    cases = {
        "[a](javascript:alert(1))": None, "[a]( javascript:alert(1))": None, "[a](JAVASCRIPT:x)": None,
        "[a](java\tscript:x)": None, "[a](data:text/html,<script>x</script>)": None, "[a](//evil.example)": None,
        "[a](vbscript:x)": None, "[a](/relative)": None, "[a](https://ok.example/p)": "https://ok.example/p",
        "[a](<http://ok.example/x y>)": "http://ok.example/x%20y",
        'see https://ok.example/"onmouseover="x': "https://ok.example/",
        "[a](https://ok.example \"title\")": "https://ok.example/",
    }
    got = page.evaluate("""(cases) => Object.keys(cases).map(src => {
        const box = document.createElement('div');
        box.appendChild(window.tidalMarkdown.render(src));
        const links = [...box.querySelectorAll('a')];
        return [src, links.length ? links[0].getAttribute('href') : null, links.length, box.querySelectorAll('script').length];
    })""", cases)
    for src, href, count, scripts in got:
        assert href == cases[src], (src, href)
        assert count <= 1 and scripts == 0, src


# The page's fetch of the chat stream replaced by a stream whose byte chunks the test chooses: one
# byte per read (every multi-byte character split), then either the end or a network error.
FAKE_FETCH = """([pieces, fail]) => {
    const real = window.fetch;
    window.fetch = (url, init) => {
        if (!String(url).endsWith('/v1/chat/completions')) return real(url, init);
        const body = new ReadableStream({
            start(c) {
                for (const p of pieces) c.enqueue(new Uint8Array(p));
                // (an error discards chunks not yet read: it comes once they are)
                if (fail) setTimeout(() => c.error(new TypeError('network error')), 100); else c.close();
            }});
        return Promise.resolve(new Response(body, {headers: {'Content-Type': 'text/event-stream'}}));
    };
}"""


def test_utf8_split_in_every_read_and_network_error(page, recorded):
    page.goto(f"http://127.0.0.1:{recorded.server_address[1]}/")
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'recorded'")
    stream = b"".join(hostile_stream())
    page.evaluate(FAKE_FETCH, [[[b] for b in stream], False])
    send(page, "bytes")
    wait_idle(page)
    reply = last_reply(page)
    assert "naïve 日本語 🌊 done." in reply.locator(".content").inner_text()
    assert "Zürich" in reply.locator(".tool-args").inner_text()
    assert not reply.locator(".turn-error").count()

    cut = stream[:stream.index("日".encode()) + 1]  # the connection drops inside a character
    page.evaluate(FAKE_FETCH, [[list(cut)], True])
    send(page, "drop")
    wait_idle(page)
    reply = last_reply(page)
    assert "connection lost" in reply.locator(".turn-error").inner_text()
    assert reply.locator(".content").inner_text().startswith("Hello <script>")  # the events before the drop
    assert page.is_enabled("#send")
    assert page.errors == []
