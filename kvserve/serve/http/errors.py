"""OpenAI's error body, and the handlers that make every failure one.

Clients (the `openai` package among them) read `{"error": {"message", "type",
"param", "code"}}`; FastAPI's own 422 for a body it cannot validate would
confuse them, so validation errors and malformed JSON are 400s here too. Any
other exception (a bug) is a 500 in the same body, never plain text. A message
is at most MAX_MESSAGE characters: it may quote the client's input.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvserve.graceful_server import LogEvery
from kvserve.request_limits import LimitError

log = logging.getLogger("kvserve.serve")
MAX_MESSAGE = 1000

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered with OpenAI's body; `param` names the field at fault."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers


def refusal(exc: LimitError) -> APIError:
    """A shared limit's refusal (kvserve.request_limits) as the 400 it is."""
    return APIError(exc.message, param=exc.param)


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    kind = _TYPES.get(status, "invalid_request_error")
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    if param is not None and len(param) > 64:
        param = param[:61] + "..."
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    body = error_body(exc.message, exc.status, exc.param, exc.code)
    return JSONResponse(body, exc.status, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    disconnects = LogEvery("a client left while sending its request", log)

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid')}" if param else "invalid request"
        return error_response(APIError(message, 400, param))

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(APIError(str(exc.detail), exc.status_code))

    async def client_gone(_: Request, exc: Exception) -> Response:
        disconnects.note()
        return Response(status_code=499)  # nobody reads it

    async def bug(_: Request, exc: Exception) -> JSONResponse:
        # Starlette's outermost handler: it logs the traceback itself after this answer.
        message = f"internal error: {type(exc).__name__}"
        return error_response(APIError(message, 500))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(Exception, bug)
