"""The chat page at ``/`` and ``/chat``: static files shipped in the package, no build step, no CDN.

The page talks to the server's own ``/v1/chat/completions`` stream and ``/metrics``. Its routes are
public even with ``--api-key`` (the page holds no secret: it asks for the key and sends it on its
API calls). Model output is never parsed as HTML: the page builds DOM nodes, and the strict
Content-Security-Policy (no inline script, connections to this origin only) is a second wall.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

# Route -> (file in this package, media type).
PAGES: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/chat": ("index.html", "text/html; charset=utf-8"),
    "/ui/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/ui/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/ui/chat.css": ("chat.css", "text/css; charset=utf-8"),
}
UI_PATHS = frozenset(PAGES)

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def asset(name: str) -> bytes:
    return resources.files(__name__).joinpath(name).read_bytes()


def page_response(path: str) -> Response:
    """The file behind ``path`` (one of :data:`PAGES`) with the page's security headers."""
    name, media_type = PAGES[path]
    return Response(asset(name), media_type=media_type, headers=HEADERS)


def add_ui_routes(app: FastAPI) -> None:
    def route(path: str):  # a closure per path: a default argument would become a query parameter
        async def serve() -> Response:
            return page_response(path)
        return serve

    for path in PAGES:
        app.add_api_route(path, route(path), methods=["GET"], include_in_schema=False)
