"""Presets: a name for a model with a system prompt and generation defaults, as Ollama's Modelfile makes them.

    FROM smollm2-135m                 the model (any name or path barellm resolves; required)
    SYSTEM You answer in French.      the system prompt a chat starts with (triple-quoted for several lines)
    PARAMETER temperature 0           a default an explicit option overrides (stop may repeat)
    TEMPLATE ...                      stored, but not applied: barellm renders the GGUF's own chat template
    # a comment

A preset is stored as presets/<name>.json under barellm's home, written atomically. It holds no weights:
removing it never touches its model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from barellm.errors import InvalidRequest, ModelNotFound

# the Modelfile's parameters barellm takes, and their types; num_predict is max_tokens, num_ctx the context
PARAMETERS: dict[str, type] = {
    "temperature": float, "top_k": int, "top_p": float, "min_p": float, "repeat_penalty": float,
    "repeat_last_n": int, "presence_penalty": float, "frequency_penalty": float, "seed": int,
    "num_predict": int, "num_ctx": int, "stop": str,
}
# the values a request's options take (serve/ollama.py's OllamaOptions): (low, high, low excluded)
RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0, 2, False), "top_k": (0, 1 << 31, False), "top_p": (0, 1, True), "min_p": (0, 1, False),
    "repeat_penalty": (1e-6, 10, False), "repeat_last_n": (-1, 1 << 31, False),
    "presence_penalty": (-2, 2, False), "frequency_penalty": (-2, 2, False), "seed": (-(1 << 63), (1 << 64) - 1, False),
    "num_predict": (-2, 1 << 31, False), "num_ctx": (16, 1 << 31, False),
}
INSTRUCTIONS = ("FROM", "SYSTEM", "PARAMETER", "TEMPLATE")
TEMPLATE_NOTE = "TEMPLATE is stored but not applied: barellm renders the model's own (GGUF) chat template"
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")
_MAX_FILE = 1 << 20


@dataclass(frozen=True)
class Preset:
    name: str
    base: str                                    # FROM: the model it runs
    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)   # Ollama's keys, typed
    template: str | None = None                  # stored only (see TEMPLATE_NOTE)

    @property
    def options(self) -> dict[str, Any]:
        """The parameters as barellm's generation options (the same mapping an Ollama model's params layer
        gets), with num_ctx as `context`."""
        from barellm.store.sources.ollama import OllamaModel, own_store

        return OllamaModel(self.name, own_store(), Path(), Path(), 0, (), dict(self.parameters)).options

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "from": self.base, "system": self.system, "parameters": self.parameters,
                "template": self.template}


def directory() -> Path:
    from barellm.files import home

    return home() / "presets"


def check_name(name: str) -> str:
    """A preset's name as it is stored (lower case, no ":latest"); an error for a name it cannot be."""
    from barellm.store.names import normalize

    key = normalize(name) if isinstance(name, str) else ""
    if not _NAME.fullmatch(key):
        raise InvalidRequest(f"{name!r} is no preset name: letters, digits, '.', '_' and '-', 100 at most, "
                             "starting with a letter or digit")
    return key


def _value(key: str, raw: Any, where: str) -> Any:
    if key not in PARAMETERS:
        raise InvalidRequest(f"{where}unknown parameter {key!r} (barellm takes: {', '.join(PARAMETERS)})")
    kind = PARAMETERS[key]
    if kind is str:
        if not isinstance(raw, str) or not raw:
            raise InvalidRequest(f"{where}parameter {key} needs a non-empty string, got {raw!r}")
        return raw
    if isinstance(raw, bool):
        raise InvalidRequest(f"{where}parameter {key} needs a number, got {raw!r}")
    try:
        value = kind(raw) if isinstance(raw, str) else raw
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise ValueError
    except (TypeError, ValueError):
        raise InvalidRequest(f"{where}parameter {key} needs {'an integer' if kind is int else 'a number'}, "
                             f"got {raw!r}") from None
    lo, hi, open_low = RANGES[key]
    if not (lo < value <= hi if open_low else lo <= value <= hi) or value != value:
        raise InvalidRequest(f"{where}parameter {key} must be in {'(' if open_low else '['}{lo}, {hi}], got {raw!r}")
    return float(value) if kind is float else value


def parameters_of(values: dict[str, Any], where: str = "") -> dict[str, Any]:
    """Parameters as a request gives them ({"temperature": 0.2, "stop": ["a", "b"]}), checked and typed."""
    if not isinstance(values, dict):
        raise InvalidRequest(f"{where}parameters must be an object, got {type(values).__name__}")
    out: dict[str, Any] = {}
    for key, raw in values.items():
        if key == "stop":
            stops = raw if isinstance(raw, list) else [raw]
            out["stop"] = [_value("stop", s, where) for s in stops]
        else:
            out[key] = _value(key, raw, where)
    return out


def _unquote(text: str, lines: list[str], i: int) -> tuple[str, int]:
    """The argument starting at lines[i] (text: what follows the instruction): a \"\"\"block\"\"\" over
    several lines, a "quoted" string, or the rest of the line. Returns it and the next line's index."""
    if text.startswith('"""'):
        rest = text[3:]
        if '"""' in rest:
            return rest[: rest.index('"""')], i + 1
        parts = [rest]
        for j in range(i + 1, len(lines)):
            if '"""' in lines[j]:
                parts.append(lines[j][: lines[j].index('"""')])
                return "\n".join(parts).strip("\n"), j + 1
            parts.append(lines[j])
        raise InvalidRequest(f'line {i + 1}: a """ block that never ends')
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1], i + 1
    return text, i + 1


def parse_modelfile(text: str) -> dict[str, Any]:
    """A Modelfile's content: {"from", "system", "parameters", "template"}; an error naming the line of
    anything barellm does not take."""
    lines = text.splitlines()
    out: dict[str, Any] = {"from": None, "system": None, "parameters": {}, "template": None}
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if not line or line.startswith("#"):
            i += 1
            continue
        word, _, rest = line.partition(" ")
        if not _:
            word, _, rest = line.partition("\t")
        instruction, rest, where = word.upper(), rest.strip(), f"line {i + 1}: "
        if instruction not in INSTRUCTIONS:
            raise InvalidRequest(f"{where}unknown instruction {word!r} (barellm takes {', '.join(INSTRUCTIONS)})")
        if not rest:
            raise InvalidRequest(f"{where}{instruction} needs a value")
        if instruction == "PARAMETER":
            key, _, raw = rest.partition(" ")
            raw = raw.strip()
            if not raw:
                raise InvalidRequest(f"{where}PARAMETER {key} needs a value")
            if len(raw) >= 2 and raw[0] == raw[-1] == '"':
                raw = raw[1:-1]
            value = _value(key.lower(), raw, where)
            if key.lower() == "stop":
                out["parameters"].setdefault("stop", []).append(value)
            else:
                out["parameters"][key.lower()] = value
            i += 1
            continue
        value, i = _unquote(rest, lines, i)
        out[instruction.lower()] = value
    if not out["from"]:
        raise InvalidRequest("the Modelfile has no FROM line: FROM names the model (a name or a path)")
    return out


def read_modelfile(path: str | Path) -> dict[str, Any]:
    p = Path(path).expanduser()
    try:
        data = p.read_bytes()[: _MAX_FILE + 1]
    except OSError as e:
        raise InvalidRequest(f"{path}: cannot read the Modelfile: {e.strerror or e}") from e
    if len(data) > _MAX_FILE:
        raise InvalidRequest(f"{path}: over 1 MiB; no Modelfile is that long")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"{path}: not UTF-8 text") from e
    try:
        return parse_modelfile(text)
    except InvalidRequest as e:
        raise InvalidRequest(f"{path}: {e}") from e


def _path(key: str) -> Path:
    return directory() / f"{key}.json"


def find(word: str | Any) -> Preset | None:
    """The preset a name stands for (any case, ":latest" allowed), or None."""
    if not isinstance(word, str) or not word or any(c in word for c in "\0\n/\\"):
        return None
    from barellm.store.names import normalize

    key = normalize(word)
    if not _NAME.fullmatch(key):
        return None
    try:
        d = json.loads(_path(key).read_text())
        return Preset(d["name"], d["from"], d.get("system"), parameters_of(d.get("parameters") or {}),
                      d.get("template"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, InvalidRequest):
        return None


def all_presets() -> list[Preset]:
    d = directory()
    if not d.is_dir():
        return []
    found = (find(p.stem) for p in sorted(d.glob("*.json")))
    return [p for p in found if p is not None]


def check_base(base: str) -> str:
    """FROM as it is stored: a path made absolute (wherever a preset is run from); an error for a path that
    is no model. Whether a name resolves is the catalogue's to say (catalog.create_preset)."""
    from barellm.store import names

    if not isinstance(base, str) or not base.strip():
        raise InvalidRequest("a preset needs FROM: the model it runs")
    base = base.strip()
    found = find(base)
    if found is not None:
        return found.base   # a preset of a preset: its model, and its own settings replace the other's
    if names.exists(base):   # a path: the file itself (or a checkpoint directory)
        path = Path(base).expanduser().resolve()
        if not (path.is_file() or (path / "config.json").is_file()):
            raise InvalidRequest(f"FROM {base}: neither a model file nor a checkpoint directory")
        return str(path)
    return base


def save(name: str, base: str, *, system: str | None = None, parameters: dict[str, Any] | None = None,
         template: str | None = None) -> Preset:
    """Checks and stores a preset (replacing one of that name), base already checked (check_base)."""
    from barellm.files import write_bytes_atomic

    key = check_name(name)
    if system is not None and not isinstance(system, str):
        raise InvalidRequest("system must be a string")
    if template is not None and not isinstance(template, str):
        raise InvalidRequest("template must be a string")
    preset = Preset(key, base, system or None, parameters_of(parameters or {}), template or None)
    directory().mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(_path(key), json.dumps(preset.to_json(), indent=1).encode())
    return preset


def remove(word: str) -> Path:
    """Removes a preset (never its model); returns the file removed."""
    preset = find(word)
    if preset is None:
        raise ModelNotFound(f"{word!r}: no such preset")
    path = _path(preset.name)
    path.unlink()
    return path
