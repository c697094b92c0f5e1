"""What a node whose own model cannot be served answers: every HTTP request gets a 503 with the
reason (``meshnode status`` shows it), so a service manager keeps one running process that says
what is wrong instead of restarting it in a loop."""

from __future__ import annotations

import asyncio

from aiohttp import web


async def refuse_until(stop: asyncio.Event, host: str, port: int, reason: str) -> None:
    """Answer every request on ``host:port`` with a 503 naming ``reason`` until ``stop`` is set."""
    body = {"error": {"message": f"this node cannot serve its model: {reason}", "type": "model_not_loadable",
                      "param": "model", "code": "model_not_loadable"}}

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
