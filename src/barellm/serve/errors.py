"""The HTTP API's error shape (OpenAI's: {"error": {"message", "type", "param", "code"}}), and the parsing of a
request body into its pydantic model (serve/schemas.py) with an error that names the first thing wrong.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)

def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"

def parse(model: type[M], raw: bytes) -> M:
    """The body validated as model, or an ApiError (400) that names the first thing wrong."""
    if not raw.strip():
        raise bad("the request body is empty; send a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]
        if first["type"] == "missing":
            # a misspelt field also leaves the real one missing: the misspelling is the news
            first = next((x for x in errors if x["type"] == "extra_forbidden"
                          and x["loc"][:-1] == first["loc"][:-1]), first)
        raise _api_error(first) from None

def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith("~"):
            out += f".{part}" if out else str(part)
    return out

def _api_error(err: Any) -> ApiError:
    where = _where(err["loc"])
    kind = err["type"]
    msg: str = err["msg"]
    if kind == "json_invalid":
        return bad(f"the body is not valid JSON: {err.get('ctx', {}).get('error', msg)}", code="invalid_json")
    if not where:
        if kind == "model_type":
            return bad("the body must be a JSON object", code="invalid_json")
        return bad(msg)
    if kind == "extra_forbidden":
        if "." in where or "[" in where:
            return bad(f"unrecognized field {where}", where, "unknown_parameter")
        return bad(f"unrecognized request argument: {where}", where, "unknown_parameter")
    if kind == "missing":
        return bad(f"{where} is required", where)
    if kind == "unsupported_parameter":
        return bad(msg, where, "unsupported_parameter")
    got = f", got {_json_type(err['input'])}" if "input" in err else ""
    if kind == "type_error":
        return bad(f"{where} {msg}{got}", where)
    ctx = err.get("ctx") or {}
    if kind in ("too_short", "too_long"):
        bound = f"at least {ctx.get('min_length')}" if kind == "too_short" else f"at most {ctx.get('max_length')}"
        n = ctx.get("min_length" if kind == "too_short" else "max_length")
        got_n = ctx.get("actual_length")
        if got_n is None and isinstance(err.get("input"), (dict, list, str)):
            got_n = len(err["input"])   # pydantic leaves the count out for a mapping
        what = "entries" if isinstance(err.get("input"), dict) else f"item{'' if n == 1 else 's'}"
        return bad(f"{where} must have {bound} {what}, got {got_n}", where)
    bounds = {"greater_than_equal": ("ge", ">="), "less_than_equal": ("le", "<="), "greater_than": ("gt", ">"),
              "less_than": ("lt", "<")}
    if kind in bounds:   # pydantic prints large bounds as floats
        key, op = bounds[kind]
        return bad(f"{where} must be {op} {ctx.get(key)}, got {err.get('input')}", where)
    if msg.startswith("Input should be "):
        if kind.endswith("_type"):
            msg += got
        return bad(f"{where} should be {msg[len('Input should be '):]}", where)
    return bad(f"{where}: {msg[:1].lower()}{msg[1:]}", where)
