"""HTTP to the local servers, never through a proxy."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    try:
        with _NO_PROXY_OPENER.open(url, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, ValueError):
        return None


def http_post(url: str, payload: dict[str, Any], timeout_s: float) -> bytes:
    """POSTs `payload` as JSON (no proxy); returns the response body."""
    req = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with _NO_PROXY_OPENER.open(req, timeout=timeout_s) as r:
        return r.read()


def http_post_json(url: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    return json.loads(http_post(url, payload, timeout_s).decode("utf-8", "replace"))
