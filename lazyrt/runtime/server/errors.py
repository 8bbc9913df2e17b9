"""ApiError: an HTTP error with OpenAI's error body, naming the offending request field; check_json:
the checks every parsed request body gets before any field is read."""

from __future__ import annotations

# what msgpack carries between the processes: an integer outside fails past validation (a 500)
INT_RANGE = (-(2**63), 2**64)
MAX_JSON_DEPTH = 100  # msgpack refuses past 511 levels, and the request's own wrapping adds some


def printable(s: str) -> str:
    """s with any lone surrogate escaped (\\ud800): an error body must encode as UTF-8."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error"
    ):
        message, param = printable(message), None if param is None else printable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }


def bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param)


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, from a \ud800 escape: no tokenizer or msgpack takes it
        return False
    return True


def _at(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def check_json(value: dict | list, path: str = "") -> None:
    """A 400 naming the JSON path (`messages[0].content`) of a string or key that is not UTF-8, an
    integer outside INT_RANGE, or a value nested past MAX_JSON_DEPTH: each would fail later, in the
    tokenizer or on the wire, as a 500. Iterative: depth costs no stack."""
    stack = [(value, path, 0)]
    while stack:
        v, where, depth = stack.pop()
        if depth >= MAX_JSON_DEPTH:
            raise bad(where or "body", f"is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(v, list) and all(type(x) is int for x in v):  # token ids: fast for long lists
            if v and INT_RANGE[0] <= min(v) and max(v) < INT_RANGE[1]:
                continue
        inner = []
        for k, x in enumerate(v) if isinstance(v, list) else v.items():
            if isinstance(k, str) and not _utf8(k):  # (ApiError escapes the surrogate in the path)
                raise bad(_at(where, k), "this key is not valid UTF-8 (a lone surrogate escape?)")
            if isinstance(x, str):
                if not _utf8(x):
                    raise bad(_at(where, k), "is not valid UTF-8 (a lone surrogate escape?)")
            elif isinstance(x, int) and not isinstance(x, bool):
                if not INT_RANGE[0] <= x < INT_RANGE[1]:
                    raise bad(_at(where, k), "integer out of range (it must fit in 64 bits)")
            elif isinstance(x, (dict, list)):
                inner.append((x, _at(where, k), depth + 1))
        stack += reversed(inner)  # popped in document order
