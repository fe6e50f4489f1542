"""An image content part's bytes: ``data:`` URLs inline; ``http(s)`` URLs fetched only when the
server allows it (``--allow-image-url-fetch``), within a time and size limit."""

from __future__ import annotations

import base64
import binascii
import time
import urllib.parse
from typing import Any

import httpx

from tidal.multimodal.decode import ImageError, ImageLimits

MAX_REDIRECTS = 5


def image_url_of(part: dict[str, Any], where: str) -> str:
    """The URL of an OpenAI ``image_url`` / ``input_image`` part (object or plain string form)."""
    value = part.get("image_url", part.get("image"))
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ImageError(f"{where}: the image part has no image_url.url")
    return value


def data_url_bytes(url: str, where: str) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageError(f"{where}: malformed data: URL (no ',' before the data)")
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"{where}: the data: URL's base64 is invalid ({e})") from None
    return urllib.parse.unquote_to_bytes(payload)


def fetch_url(url: str, limits: ImageLimits, where: str) -> bytes:
    """GET ``url`` within the limits: ``fetch_timeout`` bounds the whole fetch (a server that
    trickles bytes is cut off too, not only one that stalls), ``max_bytes`` the body (refused on
    its Content-Length before reading, else while reading); at most ``MAX_REDIRECTS`` redirects,
    each to http(s) only."""
    if not limits.allow_url_fetch:
        raise ImageError(f"{where}: fetching image URLs is disabled on this server; send the image as a data: "
                         "URL (base64), or start the server with --allow-image-url-fetch")
    too_slow = ImageError(f"{where}: fetching the image URL took longer than {limits.fetch_timeout:g} s "
                          "(--image-fetch-timeout)")
    too_big = ImageError(f"{where}: the image at the URL is larger than {limits.max_bytes} bytes (--max-image-bytes)")
    deadline = time.monotonic() + limits.fetch_timeout
    try:
        with httpx.Client(timeout=limits.fetch_timeout, follow_redirects=True, max_redirects=MAX_REDIRECTS) as client, \
                client.stream("GET", url) as r:
            if r.status_code != 200:
                raise ImageError(f"{where}: fetching the image URL gave HTTP {r.status_code}")
            declared = r.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limits.max_bytes:
                raise too_big
            chunks, size = [], 0
            for chunk in r.iter_bytes():
                size += len(chunk)
                if size > limits.max_bytes:
                    raise too_big
                if time.monotonic() > deadline:
                    raise too_slow
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.TimeoutException:
        raise too_slow from None
    except httpx.TooManyRedirects:
        raise ImageError(f"{where}: the image URL redirects more than {MAX_REDIRECTS} times") from None
    except httpx.HTTPError as e:
        raise ImageError(f"{where}: the image URL cannot be fetched ({type(e).__name__}: {e})") from None


def image_bytes(part: dict[str, Any], limits: ImageLimits, where: str) -> bytes:
    url = image_url_of(part, where)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return data_url_bytes(url, where)
    if scheme in ("http", "https"):
        return fetch_url(url, limits, where)
    raise ImageError(f"{where}: image URL scheme {scheme or '(none)'!r} is not supported; use data: or http(s):")
