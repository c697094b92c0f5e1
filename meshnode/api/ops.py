"""The mesh's own endpoints: /health (open), /v1/mesh, /metrics, the dashboard, /v1/admin/models."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from meshnode.api.core import BACKEND, METRICS, SETTINGS, json_body
from meshnode.errors import ApiError

LOOPBACK = ("127.0.0.1", "::1")

STATIC = Path(__file__).resolve().parent / "static"  # the dashboard (GET /)


async def health(request: web.Request) -> web.Response:
    ok, body = request.app[BACKEND].health()
    return web.json_response(body, status=200 if ok else 503)


async def mesh(request: web.Request) -> web.Response:
    return web.json_response(request.app[BACKEND].mesh_status())


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS]
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def admin_models(request: web.Request) -> web.Response:
    """``{"add": "<folder or id>"}`` or ``{"remove": "<model id>"}``, kept across restarts. Without
    an API key only this machine may ask (a model folder is a path on this disk)."""
    if not request.app[SETTINGS].api_key and request.remote not in LOOPBACK:
        raise ApiError(
            403,
            "admin calls need an API key (the api_key setting) or must come from this machine",
            type="permission_error",
            code="admin_forbidden",
        )
    body = await json_body(request)
    if (
        not isinstance(body, dict)
        or len(body) != 1
        or not isinstance(next(iter(body.values())), str)
        or next(iter(body)) not in ("add", "remove")
        or not next(iter(body.values())).strip()
    ):
        raise ApiError(400, 'expected {"add": "<model folder or id>"} or {"remove": "<model id>"}')
    backend = request.app[BACKEND]
    if "add" in body:
        return web.json_response(await backend.add_model(body["add"].strip()))
    return web.json_response(await backend.remove_model(body["remove"].strip()))


def routes(app: web.Application) -> None:
    app.router.add_post("/v1/admin/models", admin_models)
    app.router.add_get("/v1/mesh", mesh)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", dashboard)
    app.router.add_static("/static/", STATIC)
