"""A node that cannot serve its model answers every request with a 503 and the reason, so a service
manager keeps one process saying what is wrong rather than restarting it in a loop."""

from __future__ import annotations

import asyncio

from aiohttp import web


async def refuse_until(stop: asyncio.Event, host: str, port: int, reason: str) -> None:
    """Answers 503 naming ``reason`` until ``stop`` is set."""
    body = {
        "error": {
            "message": f"this node cannot serve its model: {reason}",
            "type": "model_not_loadable",
            "param": "model",
            "code": "model_not_loadable",
        }
    }

    async def refuse(_request: web.Request) -> web.Response:
        return web.json_response(body, status=503)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
