"""What the request bodies of every API (schemas.py's OpenAI ones, ollama.py's and lifecycle.py's Ollama ones) are
built from: the strict base model, the limits they share, field types (JSON's one number type read as an integer
where one is due, Ollama's durations, probabilities), unions whose branch is chosen from the value, fields barellm
does not implement, and the pieces that state cross-field rules in the OpenAPI document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, WithJsonSchema
from pydantic_core import PydanticCustomError, core_schema

from barellm.serve.errors import _json_type

MAX_BODY_BYTES = 1 << 20
MAX_STOPS = 16
MAX_STOP_CHARS = 1000
MAX_MESSAGES = 4096
INT64 = 1 << 63
UINT31 = 1 << 31


# --- field types -----------------------------------------------------------------------------------

def _integral(v: Any) -> Any:
    # JSON has one number type: 16.0 means 16, and 1e20 is an integer too (1.5 stays a float and fails the
    # integer check; a field's bounds then judge the value)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


Int = Annotated[int, BeforeValidator(_integral)]
# Ollama's keep_alive as text: read by serve.models.parse_keep_alive (Go's durations such as "5m" or "1h30m",
# or a bare number of seconds), which names what is wrong; the document states the part of that grammar with
# few enough digits to stay finite
DURATION_PATTERN = (r"^-?((\d{1,9}(\.\d{0,9})?|\.\d{1,9})(ns|us|µs|ms|s|m|h))+$"
                    r"|^-?(\d{1,9}(\.\d{0,9})?|\.\d{1,9})$")
Duration = Annotated[str, WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN})]
Prob = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]

# A union's branch is chosen from the value (its JSON type, or its "type" field), so only that branch is
# validated and an error is about it alone. Branch tags start with "~": they show in an error's location,
# where _where() leaves them out.


def _by_json_type(v: Any) -> str | None:
    return {"string": "~string", "array": "~array", "object": "~object"}.get(_json_type(v))


def _by_type_field(v: Any) -> str | None:
    return f"~{v['type']}" if isinstance(v, dict) and isinstance(v.get("type"), str) else None


def _tagged(*branches: type[BaseModel], what: str) -> Any:
    """A union of objects told apart by their "type" field (each branch's Literal)."""
    return Annotated[Union[tuple(Annotated[b, Tag(f"~{b.model_fields['type'].annotation.__args__[0]}")]  # noqa: UP007
                                 for b in branches)],
                     Discriminator(_by_type_field, custom_error_type="type_error", custom_error_message=what)]


def _either(string: Any, array: Any, what: str) -> Any:
    """A value that is a string or an array (of whatever array says): OpenAI's usual 'one or many'."""
    return Annotated[Union[Annotated[string, Tag("~string")], Annotated[array, Tag("~array")]],  # noqa: UP007
                     Discriminator(_by_json_type, custom_error_type="type_error", custom_error_message=what)]


T = TypeVar("T")


def _neutral(v: Any, n: Any) -> bool:
    if isinstance(n, bool) or isinstance(v, bool):
        return v is n
    if isinstance(n, (int, float)):
        return isinstance(v, (int, float)) and v == n
    return type(v) is type(n) and v == n


@dataclass(frozen=True)
class _Off:
    """A field barellm does not implement (yet): its neutral values (and null) pass, anything else is refused.
    The document states the neutral values as the field's schema, so that a schema-valid request is one the
    server accepts."""

    name: str
    neutral: tuple[Any, ...]
    what: str

    def check(self, v: T) -> T:
        if v is not None and not any(_neutral(v, n) for n in self.neutral):
            raise PydanticCustomError("unsupported_parameter", f"{self.name} is not supported by this server "
                                                               f"({self.what})")
        return v

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        return {"anyOf": [*({"const": n} for n in self.neutral), {"type": "null"}],
                "description": f"not supported ({self.what}): accepted only as one of these"}


EMPTY = ([], {}, "", False)   # what an unimplemented field may hold: nothing


def _off(name: str, neutral: tuple[Any, ...], what: str) -> _Off:
    return _Off(name, neutral, what)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, hide_input_in_errors=True)


# --- cross-field rules, as the document states them ---------------------------------------------------

def _not_null(name: str) -> dict[str, Any]:
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def _null(*names: str) -> dict[str, Any]:
    return {"properties": {n: {"type": "null"} for n in names}}


def _either_of(*alternatives: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": list(alternatives)}
