"""Time to parse and validate one typical chat request body: the server's pydantic models, and the same
checks written as msgspec Structs (pip install msgspec) for comparison.

    python bench/request_validation.py
"""

from __future__ import annotations

import json
import timeit
from typing import Annotated, Literal, Union

from barellm.serve import schemas

BODY = json.dumps({
    "model": "smollm2-135m",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": [{"type": "text", "text": "And of Italy? Say it in one word."}]},
    ],
    "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "seed": 42, "stop": ["\n\n"],
    "stream": True, "stream_options": {"include_usage": True},
}).encode()


try:
    import msgspec

    class TextPart(msgspec.Struct, forbid_unknown_fields=True):
        type: Literal["text"]
        text: str

    class Message(msgspec.Struct, forbid_unknown_fields=True):
        role: Literal["system", "developer", "user", "assistant"]
        content: Union[str, list[TextPart]]  # noqa: UP007
        name: Union[str, None] = None  # noqa: UP007

    class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
        include_usage: bool = False

    class Chat(msgspec.Struct, forbid_unknown_fields=True):
        messages: Annotated[list[Message], msgspec.Meta(min_length=1, max_length=4096)]
        model: Union[str, None] = None  # noqa: UP007
        max_tokens: Union[Annotated[int, msgspec.Meta(ge=1)], None] = None  # noqa: UP007
        temperature: Union[Annotated[float, msgspec.Meta(ge=0, le=2)], None] = None  # noqa: UP007
        top_p: Union[Annotated[float, msgspec.Meta(ge=0, le=1)], None] = None  # noqa: UP007
        seed: Union[int, None] = None  # noqa: UP007
        stop: Union[str, list[str], None] = None  # noqa: UP007
        stream: bool = False
        stream_options: Union[StreamOptions, None] = None  # noqa: UP007
except ImportError:
    msgspec = None


def _time(fn: object, n: int = 20000) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6   # type: ignore[arg-type]


def main() -> None:
    print(f"a {len(BODY)}-byte chat request, best of 5, microseconds per body:")
    print(f"  json.loads only                       {_time(lambda: json.loads(BODY)):6.1f}")
    print(f"  pydantic model_validate_json          "
          f"{_time(lambda: schemas.ChatCompletionRequest.model_validate_json(BODY)):6.1f}")
    print(f"  pydantic, to the scheduler's request  {_time(lambda: schemas.chat_request(BODY)):6.1f}")
    if msgspec is None:
        print("  (msgspec is not installed: pip install msgspec)")
        return
    decoder = msgspec.json.Decoder(Chat)
    print(f"  msgspec Decoder(Struct)               {_time(lambda: decoder.decode(BODY)):6.1f}")


if __name__ == "__main__":
    main()
