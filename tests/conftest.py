"""Shared test helpers. Fixtures for the real Triton come from the `tunegate` pytest plugin."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def http_json(method: str, url: str, obj: Any = None, timeout: float = 30) -> tuple[int, Any]:
    body = json.dumps(obj).encode() if obj is not None else None
    code, _h, raw = http(method, url, body, {"Content-Type": "application/json"}, timeout)
    return code, (json.loads(raw) if raw else None)
