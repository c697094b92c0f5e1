"""CORS: off unless configured; when configured, only the listed origins' pages may call the API
(preflights answered without the API key, the calls themselves still need it)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from meshnode.config import load_settings
from tests.helpers import running_node

pytestmark = pytest.mark.timeout(120)

ALLOWED, OTHER = "http://dash.example:3000", "http://evil.example"


def _call(url: str, method: str = "GET", headers: dict | None = None):
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


def test_no_cors_headers_unless_configured(tmp_path):
    with running_node(None, tmp_path) as (_, base):
        status, headers = _call(f"{base}/v1/models", headers={"Origin": ALLOWED})
        assert status == 200 and "Access-Control-Allow-Origin" not in headers
        status, headers = _call(
            f"{base}/v1/chat/completions", "OPTIONS", {"Origin": ALLOWED, "Access-Control-Request-Method": "POST"}
        )
        assert "Access-Control-Allow-Origin" not in headers


@pytest.mark.slow
def test_listed_origins_only_and_the_key_still_guards_the_calls(tmp_path):
    with running_node(None, tmp_path, cors_origins=[ALLOWED], api_key="s3cret") as (_, base):
        status, headers = _call(
            f"{base}/v1/chat/completions",
            "OPTIONS",
            {
                "Origin": ALLOWED,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert status == 200 and headers["Access-Control-Allow-Origin"] == ALLOWED
        assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
        status, headers = _call(
            f"{base}/v1/chat/completions", "OPTIONS", {"Origin": OTHER, "Access-Control-Request-Method": "POST"}
        )
        assert status == 403 and "Access-Control-Allow-Origin" not in headers
        status, headers = _call(f"{base}/v1/models", headers={"Origin": ALLOWED, "Authorization": "Bearer s3cret"})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == ALLOWED
        status, headers = _call(f"{base}/v1/models", headers={"Origin": ALLOWED})
        assert status == 401  # a page of an allowed origin still needs the key
        status, headers = _call(f"{base}/v1/models", headers={"Origin": OTHER, "Authorization": "Bearer s3cret"})
        assert status == 200 and "Access-Control-Allow-Origin" not in headers  # the browser withholds it


def test_origins_are_validated():
    assert load_settings(None, env={"MESHNODE_CORS_ORIGINS": "https://a.example, http://b:8080"}).cors_origins == (
        "https://a.example",
        "http://b:8080",
    )
    assert load_settings(None, env={}, flags={"cors_origins": ["*"]}).cors_origins == ("*",)
    with pytest.raises(Exception, match="origin"):
        load_settings(None, env={"MESHNODE_CORS_ORIGINS": "javascript:alert(1)"})
