"""The server's errors in OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}`
(vLLM's too): a one-line message, `param` naming the request field at fault. Imports FastAPI
for the response only."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        return JSONResponse({"error": error}, status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def internal_error(e: Exception) -> APIError:
    """A bug's 500: one line naming the exception."""
    first_line = next(iter(str(e).splitlines()), "")
    return APIError(500, f"internal server error: {type(e).__name__}: {first_line}".rstrip(": "), None,
                    "server_error")
