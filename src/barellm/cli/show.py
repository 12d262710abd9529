"""`barellm show MODEL`: what a model is, as `ollama show` says it: architecture, parameters, context,
embedding size, quantization, instruct or base, and its chat template; read from the file's header, the
model not loaded."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="a model's architecture, parameters, context, quantization and template",
                       description="Shows what a model is (a name `barellm list` shows, or a path to a model "
                                   "file): its architecture, parameter count, context and embedding length, "
                                   "quantization (the file type as llama.cpp names it), whether it is an "
                                   "instruct or a base model, and the start of its chat template.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--template", action="store_true", help="print the whole chat template, and nothing else")
    p.set_defaults(func=cmd_show)


def parameter_size(n: int) -> str:
    """A parameter count as model names give it: 135M, 1.5B."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def quantization(metadata: dict[str, Any], tensors: dict[str, Any]) -> str:
    """The file type as llama.cpp names it (Q4_K_M); where the file does not say, the type that holds
    most of its matrices' bytes."""
    from barellm.formats.file_types import file_type_name
    from barellm.formats.quant import TYPES

    named = file_type_name(metadata)
    if named:
        return named
    by_bytes: Counter[str] = Counter()
    for t in tensors.values():
        if len(t.shape) == 2:
            row = TYPES.get(t.type)
            by_bytes[row.name.upper() if row else f"type {t.type}"] += int(t.nbytes)
    return by_bytes.most_common(1)[0][0] if by_bytes else "unknown"


def describe(metadata: dict[str, Any], tensors: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows `show` prints, label and value."""
    from barellm.store.hub import is_instruct

    arch = str(metadata.get("general.architecture", "unknown"))
    n_params = sum(math.prod(map(int, t.shape)) for t in tensors.values())
    rows = [("architecture", arch), ("parameters", parameter_size(n_params))]
    for label, key in (("context length", "context_length"), ("embedding length", "embedding_length")):
        value = metadata.get(f"{arch}.{key}")
        if value is not None:
            rows.append((label, str(value)))
    rows.append(("quantization", quantization(metadata, tensors)))
    rows.append(("kind", "instruct (a chat template in the file)" if is_instruct(metadata) else
                 "base (no chat template: `run` continues text)"))
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        from barellm.text.reasoning import reasoning_format

        tokens = metadata.get("tokenizer.ggml.tokens")
        fmt = reasoning_format(template, lambda t: isinstance(tokens, list) and t in tokens)
        if fmt is not None:
            rows.append(("reasoning", {"harmony": "harmony channels (gpt-oss): analysis, then the final answer",
                                       "think": "<think>...</think> before the answer"}[fmt]))
    return rows


def cmd_show(args: argparse.Namespace) -> int:
    from barellm.errors import FormatError
    from barellm.formats import sniff
    from barellm.store import catalog, presets
    from barellm.store.converted import open_model

    preset = presets.find(args.model)
    if preset is not None and not args.template:
        print(f"  Preset  {preset.name}")
        print(f"    {'from':<20}{preset.base}")
        if preset.system:
            print(f"    {'system':<20}" + preset.system.replace("\n", "\n" + " " * 24))
        for key, value in preset.parameters.items():
            for v in value if isinstance(value, list) else [value]:
                print(f"    {key:<20}{json.dumps(v) if isinstance(v, str) else v}")
        if preset.template:
            print(f"    {'template':<20}stored, not applied: the model's own chat template is used")
        print()
    path = Path(catalog.resolve(args.model, pull_missing=False))
    if sniff(path) == "hf":
        raise FormatError(f"{path}: a checkpoint directory; `barellm convert` it and show the .blm")
    src = open_model(path, convert=False, prefetch=False)
    metadata, tensors = dict(src.metadata), src.tensors
    template = metadata.get("tokenizer.chat_template")
    template = template if isinstance(template, str) and template.strip() else None
    if args.template:
        if template is None:
            raise FormatError(f"{args.model} has no chat template: a base model")
        print(template.rstrip("\n"))
        return 0
    name = metadata.get("general.name")
    print(f"  Model{f'  ({name})' if isinstance(name, str) and name else ''}")
    for label, value in describe(metadata, tensors):
        print(f"    {label:<20}{value}")
    print(f"    {'file':<20}{path}")
    if template is not None:
        lines = template.strip("\n").splitlines()
        print("\n  Template" + (f"  (first 6 of {len(lines)} lines; --template prints it all)" if len(lines) > 6
                                else ""))
        for line in lines[:6]:
            print(f"    {line[:110]}{'…' if len(line) > 110 else ''}")
    return 0
