"""ApiError: an HTTP error with OpenAI's error body, naming the offending request field."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }


def bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param)
