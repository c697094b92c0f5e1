"""The mesh's own endpoints, beside the model APIs: /health (open, for load balancers and service
managers), /v1/mesh (the dashboard's data), /metrics (Prometheus) and the dashboard's files."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from meshnode.api.core import BACKEND, METRICS

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


def routes(app: web.Application) -> None:
    app.router.add_get("/v1/mesh", mesh)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", dashboard)
    app.router.add_static("/static/", STATIC)
