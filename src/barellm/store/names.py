"""What a word given as a model means, before anything is looked up: the one reading of model references
that the command line, `barellm.load()` and the server share.

    hf.co/ORG/REPO[:QUANT]   hf://ORG/REPO[:QUANT]   ORG/REPO:QUANT      a GGUF repository on Hugging Face
    ollama:NAME[:TAG]                                                    Ollama's library (registry)
    ./model.gguf   /x/y.blm   an existing file                           a file
    smollm2-135m   SmolLM2-135M   smollm2:135m   smollm2:latest   llama3.2:1b      a name

Names compare case-insensitively; ":latest" means the name alone (the catalogue's default size), and a
size tag is the catalogue's "-SIZE" (`qwen2.5-coder:0.5b` is qwen2.5-coder-0.5b). Whether a name is known
is the catalogue's business (store/catalog.py): this module only says what shape a word has, so that a word
shaped like a model reference is never taken for the start of a prompt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

HF_PREFIXES = ("hf.co/", "huggingface.co/", "hf://", "https://huggingface.co/", "https://hf.co/")
OLLAMA_PREFIX = "ollama:"
MODEL_SUFFIXES = (".gguf", ".blm")

Kind = Literal["huggingface", "ollama", "path", "name"]

# ORG/REPO as Hugging Face allows them: letters, digits, '-', '_', '.'
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# a size tag: 135m, 0.5b, 7B, 1.5b-instruct
_SIZE_TAG = re.compile(r"\d+(?:\.\d+)?[mb](?:-[\w.]+)*", re.IGNORECASE)
# NAME:TAG as Ollama spells its models (llama3.2:1b, qwen2.5-coder:1.5b-instruct-q4_K_M); a name starts with a
# letter, so that a time (12:30) stays a prompt
_NAME_TAG = re.compile(r"[A-Za-z][\w.-]*(?:/[\w.-]+)?:[\w.-]+")
# a model name with its size at the end (smollm2-135m, qwen2.5-coder-7b, llama3.2-1b-instruct)
_SIZED_NAME = re.compile(r"[a-z][\w.]*(?:-[\w.]+)*[-:]\d+(?:\.\d+)?[mb](?:-[\w.]+)*", re.IGNORECASE)
# a lower-case family name with its version (llama3.2, phi3, qwen2.5-coder, gemma3): how model families are
# named, and rarely how a prompt starts (three letters at least: "mp3" starts a prompt)
_VERSIONED_NAME = re.compile(r"[a-z]{3,}\d+(?:\.\d+)*(?:-[a-z0-9.]+)*")


@dataclass(frozen=True)
class Reference:
    """A model reference, read. name: for "huggingface" ORG/REPO, for "ollama" NAME (NAMESPACE/NAME
    outside the library), for "path" the path, for "name" the normalized name (see `normalize`); tag: the
    quant (Hugging Face) or the tag (Ollama), None when not given."""

    kind: Kind
    text: str
    name: str
    tag: str | None = None

    def __str__(self) -> str:
        if self.kind == "huggingface":
            return f"hf.co/{self.name}" + (f":{self.tag}" if self.tag else "")
        if self.kind == "ollama":
            return f"{OLLAMA_PREFIX}{self.name}:{self.tag or 'latest'}"
        return self.text


def exists(word: str) -> bool:
    """Whether a word names an existing file or directory; False for what cannot be a path at all (too long,
    a NUL byte in it)."""
    try:
        return bool(word) and Path(word).expanduser().exists()
    except (OSError, ValueError, RuntimeError):   # RuntimeError: ~user of no such user
        return False


def normalize(name: str) -> str:
    """A name as the catalogue keys it: lower case, no ":latest", a size tag joined with "-"
    (`SmolLM2:135M` -> smollm2-135m); any other tag stays (`llama3.2:1b-q8_0` keeps its colon only when
    the tag is no size)."""
    key = name.strip().lower().removesuffix(":latest")
    base, colon, tag = key.rpartition(":")
    if colon and base and _SIZE_TAG.fullmatch(tag):
        return f"{base}-{tag}"
    return key


def _split_tag(text: str) -> tuple[str, str | None]:
    base, colon, tag = text.rpartition(":")
    return (base, tag) if colon and base and tag else (text, None)


def parse(word: str) -> Reference:
    """What a model reference is, by its shape alone (an existing file is a path whatever its shape)."""
    text = word.strip()
    lower = text.lower()
    for prefix in HF_PREFIXES:
        if lower.startswith(prefix):
            repo, quant = _split_tag(text[len(prefix):].strip("/"))
            return Reference("huggingface", word, repo, quant)
    if lower.startswith(OLLAMA_PREFIX):
        name, tag = _split_tag(text[len(OLLAMA_PREFIX):])
        name = name.lower()
        return Reference("ollama", word, name.removeprefix("library/"), tag.lower() if tag else None)
    if exists(text) or lower.endswith(MODEL_SUFFIXES) or text.startswith(("/", "./", "../", "~")):
        return Reference("path", word, text)
    repo, quant = _split_tag(text)
    if quant is not None and _REPO.fullmatch(repo):
        return Reference("huggingface", word, repo, quant)
    if "/" in text or "\\" in text:
        return Reference("path", word, text)
    return Reference("name", word, normalize(text))


def is_repo(text: str) -> bool:
    """Whether text is shaped like a Hugging Face repository id, ORG/REPO."""
    return bool(_REPO.fullmatch(text))


def looks_like_model(word: str) -> bool:
    """Whether a word is shaped like a model reference, known or not: a Hugging Face or Ollama reference,
    something shaped like a path (a "/" in it, a .gguf or .blm at its end, an existing file), NAME:TAG,
    a name with its size at its end (NAME-135m), or a family with its version (llama3.2). A word with
    whitespace in it is none of these (a quoted prompt) unless it is an existing file."""
    if not word or word == "-":
        return False
    if any(c.isspace() for c in word):
        return exists(word)
    if "\0" in word:
        return False
    kind = parse(word).kind
    if kind != "name":
        return True
    return bool(_NAME_TAG.fullmatch(word) or _SIZED_NAME.fullmatch(word) or _VERSIONED_NAME.fullmatch(word))
