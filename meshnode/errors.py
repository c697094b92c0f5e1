"""The one error a request can end with, whichever layer finds it: an HTTP status, an OpenAI-style
body and headers (Retry-After while re-planning). The API makes it the response or, mid-stream, an
error event; serving raises it without depending on the API."""

from __future__ import annotations

from typing import Any, NoReturn


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


async def abort(context: Any, code: Any, details: str) -> NoReturn:
    """Ends a gRPC call with ``code`` and ``details`` (grpc.aio's ``context.abort`` raises)."""
    await context.abort(code, details)
    raise AssertionError("context.abort returned")
