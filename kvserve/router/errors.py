"""OpenAI's error body for everything the router answers itself.

Clients (the `openai` package among them) read `{"error": {"message", "type", "param",
"code"}}` whatever the status; Starlette's own 404 and 405 (`{"detail": ...}`) would not
parse, so they are rewritten here. The router cannot import serve/http/errors.py (its
room stays free of the server), hence this small copy of the body's shape.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

RETRY_AFTER_SECONDS = 1
"""What a 503 of the router's own asks the client to wait before trying again."""

_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


def error(
    message: str,
    status: int,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> JSONResponse:
    """OpenAI's error body; a 503 carries Retry-After."""
    kind = _TYPES.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    if status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS), **(headers or {})}
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Starlette's 404 (no such route) and 405 (wrong method, with Allow) in OpenAI's body;
    any other exception (a bug) a 500 in the same body, never Starlette's plain text."""

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"no route {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error(message, exc.status_code, headers=dict(exc.headers or {}))

    async def bug(request: Request, exc: Exception) -> JSONResponse:
        # Starlette's outermost handler: it logs the traceback itself after this answer.
        return error(f"internal error: {type(exc).__name__}", 500)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, bug)
