"""Constrained-decoding engines side by side on one model's vocabulary: llguidance, outlines-core, xgrammar.

For each engine installed, from barellm's own tokenizer (the token bytes every engine is given):
  - the one-off vocabulary setup,
  - compiling a JSON schema (first time, nothing cached),
  - the mask of every step along a valid answer (median and worst microseconds per token).

    python bench/structured_engines.py [MODEL] [--repeat 3]

xgrammar needs torch (its bitmasks are torch tensors), so it runs only where torch is installed; barellm does
not depend on it. docs/structured.md has the figures and why llguidance was chosen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = json.dumps({"name": "Ann Smith", "age": 31, "email": "ann@example.com", "tags": ["admin", "user"],
                     "address": {"street": "5 Main Street", "city": "Springfield", "zip": "12345"}})


def token_bytes(tok: Any, n_vocab: int) -> list[bytes]:
    return [tok.token_bytes(i) if i < tok.vocab_size else b"" for i in range(n_vocab)]


def run_llguidance(model: Any, ids: list[int]) -> dict[str, Any]:
    from barellm import structured

    t0 = time.perf_counter()
    vocab = structured.Vocabulary(model.tokenizer, model.config.n_vocab)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = vocab.json_schema(SCHEMA)
    compile_s = time.perf_counter() - t0
    matcher = grammar._matcher.deep_copy()
    mask = np.zeros(vocab.words, np.uint32)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        times.append(time.perf_counter() - t0)
        assert mask[t // 32] >> (t % 32) & 1, "llguidance refused a token of the valid answer"
        assert matcher.consume_token(t)
    return {"setup_s": setup, "compile_s": compile_s, "mask_us": times}


def run_outlines(model: Any, ids: list[int]) -> dict[str, Any]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    tok = model.tokenizer
    t0 = time.perf_counter()
    eos = sorted(tok.eog_ids)[0]
    table: dict[bytes, list[int]] = {}
    for i, b in enumerate(token_bytes(tok, model.config.n_vocab)):
        if b and i not in tok.eog_ids and not tok.is_special(i):
            table.setdefault(b, []).append(i)
    vocab = Vocabulary(eos, table)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab)
    compile_s = time.perf_counter() - t0
    guide = Guide(index)
    mask = np.zeros((model.config.n_vocab + 31) // 32, np.uint32)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        times.append(time.perf_counter() - t0)
        assert mask[t // 32] >> (t % 32) & 1, "outlines-core refused a token of the valid answer"
        guide.advance(t)
    return {"setup_s": setup, "compile_s": compile_s, "mask_us": times}


def run_xgrammar(model: Any, ids: list[int]) -> dict[str, Any]:
    import xgrammar as xgr

    tok = model.tokenizer
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(token_bytes(tok, model.config.n_vocab), vocab_type=xgr.VocabType.RAW,
                             vocab_size=model.config.n_vocab, stop_token_ids=sorted(tok.eog_ids))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, model.config.n_vocab)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t0)
        word = int(bitmask[0, t // 32]) & 0xFFFFFFFF
        assert word >> (t % 32) & 1, "xgrammar refused a token of the valid answer"
        assert matcher.accept_token(t)
    return {"setup_s": setup, "compile_s": compile_s, "mask_us": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import barellm

    model = barellm.load(args.model)
    ids = model.tokenizer.encode(ANSWER)
    print(f"{args.model}: vocabulary {model.config.n_vocab}, answer {len(ids)} tokens")
    for name, fn in (("llguidance", run_llguidance), ("outlines-core", run_outlines), ("xgrammar", run_xgrammar)):
        runs = []
        try:
            for _ in range(args.repeat):
                runs.append(fn(model, ids))
        except ImportError as e:
            print(f"{name:14s} not installed ({e})")
            continue
        except Exception as e:  # noqa: BLE001 - an engine that cannot run the schema says so and the others go on
            print(f"{name:14s} failed: {type(e).__name__}: {e}")
            continue
        setup = statistics.median(r["setup_s"] for r in runs)
        comp = statistics.median(r["compile_s"] for r in runs)
        masks = [t for r in runs for t in r["mask_us"][1:]]   # the first mask comes with the compile
        print(f"{name:14s} setup {setup * 1e3:8.1f} ms   compile {comp * 1e3:8.1f} ms   mask median "
              f"{statistics.median(masks) * 1e6:7.1f} us, max {max(masks) * 1e6:8.1f} us")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
