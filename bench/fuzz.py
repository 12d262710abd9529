"""Hostile-input campaign: mutated model files run through both engines, each in a process of its own.

    python bench/fuzz.py -n 200 --models tiny                      a short run (what CI runs)
    nice -n 19 python bench/fuzz.py -n 20000 --models tiny,smollm --save fuzz-finds   a long one

Each case takes a real model file and mutates it: the cached SmolLM2 GGUF and its .blm, and tiny synthetic
models from tests/tiny_model.py (a GGUF in two type mixes, and .blm conversions in both layouts). Mutations:
bit flips and boundary integers (0, -1, 2^31, 2^63, ...) in the header, in the data or anywhere; truncation,
appended bytes, spliced chunks; for the tiny GGUF, boundary integers written into named fields (counts,
string lengths, value types, dimensions, tensor types and offsets) and whole files rewritten from mutated
metadata (hyperparameters, token ids, vocabularies, chat templates, tensor types); for a .blm, header
mutations are followed half the time by a fresh header checksum (and data mutations by fresh tensor
checksums), so that what lies past the checksum is exercised too.

A forked child loads the file with each engine (`barellm.load(..., engine=...)`, converting a GGUF into a
scratch cache half the time and reading it directly otherwise) and generates a few tokens, plain and through
the chat template. Outcomes, by case:

    ok      every engine loaded and generated
    clean   a BarellmError (one clear line), as a malformed file should end
    crash   the child died of a signal (segfault, abort, ...)
    hang    the child was still running after --timeout seconds, and was killed
    other   an exception that is not a BarellmError: a bug

The counts are printed (--json: as JSON); with --save DIR, the input of every crash, hang and other case is
kept there for replay (`--replay FILE`). Case k of a seed is the same mutation on every run.
"""

from __future__ import annotations

import os

# one thread for NumPy's BLAS in the forking parent (a thread pool does not survive fork)
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import select  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
import zlib  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tiny model and the GGUF writer of the tests

OUTCOMES = ("ok", "clean", "crash", "hang", "other")
INTERESTING = (0, 1, 2, 3, 7, 8, 16, 31, 32, 64, 127, 128, 255, 256, 4095, 4096, 65535, 65536, 1 << 20, 1 << 24,
               (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -1, -2)
QUANT_TYPES = (0, 1, 2, 3, 6, 7, 8, 12, 14, 30)  # F32 F16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q6_K BF16
HOSTILE_TEMPLATES = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 999999999 }}",
    "{{ '{:>999999999}'.format('a') }}",
    "{{ messages[0].content.__class__ }}",
    "{% for m in messages %}{{ m.content }}",
    "{{ raise_exception('no') }}",
    "",
)


@dataclass
class Base:
    """A model file to mutate, with the offsets of its parts."""

    name: str
    path: Path
    kind: str                       # "gguf" or "blm"
    data_offset: int                # start of the tensor data section
    fields: dict[str, int] = field(default_factory=dict)   # named GGUF fields (the tiny GGUF only)
    tensors: list[tuple[int, int, int]] = field(default_factory=list)  # .blm: (data offset, size, entry offset)
    rebuild: Callable[[random.Random, Path], str] | None = None  # writes a semantically mutated file


# --- the files to mutate ----------------------------------------------------------------------------------

def _blm_base(name: str, path: Path) -> Base:
    from barellm.formats.blm import BLMFile

    with BLMFile(path) as f:
        infos = list(f.tensors.values())
        end = 64 + f.header_size
        data_offset = f.data_offset
    entries, pos = [], end
    for info in reversed(infos):  # the table is the header's last section: walk it back from its end
        pos -= 64
        entries.append((info.offset, info.nbytes, pos))
        pos -= 2 + len(info.name.encode())
    return Base(name, path, "blm", data_offset, tensors=entries[::-1])


def tiny_bases(workdir: Path) -> list[Base]:
    from barellm.store.convert import convert

    import tiny_model
    from gguf_writer import write_gguf

    bases = []
    for label, kw in (("tiny-q4_1", {}), ("tiny-mixed", {"layer_type": 2, "embd_type": 1, "tied": True})):
        captured: dict = {}

        def capture(path, md, tensors, captured=captured, **k):
            captured.update(md=md, tensors=tensors)
            return write_gguf(path, md, tensors, **k)

        tiny_model.write_gguf, original = capture, tiny_model.write_gguf
        try:
            path = tiny_model.write_tiny_llama(workdir / f"{label}.gguf", **kw)
        finally:
            tiny_model.write_gguf = original
        built = write_gguf(path, captured["md"], captured["tensors"])
        md, tensors = dict(captured["md"]), list(captured["tensors"])

        def rebuild(rng: random.Random, out: Path, md=md, tensors=tensors) -> str:
            m, ts = dict(md), list(tensors)
            what = []
            for _ in range(rng.randint(1, 3)):
                what.append(_mutate_semantics(rng, m, ts))
            write_gguf(out, {k: v for k, v in m.items() if v is not _DROP}, ts)
            return "; ".join(what)

        bases.append(Base(label, path, "gguf", built.fields["data"], fields=built.fields, rebuild=rebuild))
        for layout in ("rows", "kernels"):
            out = convert(path, workdir / f"{label}-{layout}.blm", layout=layout, progress=False)
            bases.append(_blm_base(f"{label}-{layout}.blm", out))
    return bases


def smollm_bases() -> list[Base]:
    from barellm.formats.gguf import GGUFFile
    from barellm.store import hub
    from barellm.store.converted import open_model

    gguf = hub.resolve("smollm2-135m", pull_missing=False)
    with GGUFFile(gguf) as g:
        offset = g.data_offset
    cached = open_model(gguf)
    blm_path = Path(cached.path)
    cached.close()
    return [Base("smollm2.gguf", gguf, "gguf", offset), _blm_base("smollm2.blm", blm_path)]


# --- mutations ----------------------------------------------------------------------------------------------

_DROP = object()


def _random_value(rng: random.Random):
    from gguf_writer import VT, Value

    choice = rng.randrange(9)
    if choice == 0:
        return rng.choice(INTERESTING)
    if choice == 1:
        return Value(rng.choice((VT.INT32, VT.UINT64, VT.INT64)), rng.choice(INTERESTING) % (1 << 31))
    if choice == 2:
        return rng.choice((0.0, -1.0, 1e38, float("nan"), float("inf"), 1e-45))
    if choice == 3:
        return rng.choice(("", "x" * rng.randint(1, 5000), "\udcff\udcfe", "llama", "gpt2", "gemma3", "qwen2"))
    if choice == 4:
        return rng.choice((True, False))
    if choice == 5:
        return [rng.choice(INTERESTING) % 1000 for _ in range(rng.randint(1, 20))]
    if choice == 6:
        return ["a", "b", "\udcff"][: rng.randint(1, 3)]
    if choice == 7:
        return rng.choice(HOSTILE_TEMPLATES)
    return _DROP


def _mutate_semantics(rng: random.Random, md: dict, tensors: list) -> str:
    """One change to a tiny model's metadata or tensors, written as a well-formed GGUF."""
    kind = rng.randrange(5)
    if kind <= 1:
        key = rng.choice(list(md))
        md[key] = v = _random_value(rng)
        return f"metadata {key} = {'(dropped)' if v is _DROP else repr(v)[:60]}"
    if kind == 2:  # a vocabulary entry or token type
        toks = list(md["tokenizer.ggml.tokens"])
        i = rng.randrange(len(toks))
        toks[i] = rng.choice(("", toks[(i + 1) % len(toks)], "\udcff", "<|im_start|>", "x" * 300, "Ġ"))
        md["tokenizer.ggml.tokens"] = toks
        return f"token {i} = {toks[i][:20]!r}"
    if kind == 3:  # a tensor in another type
        i = rng.randrange(len(tensors))
        name, values, _ = tensors[i]
        t = rng.choice(QUANT_TYPES)
        tensors[i] = (name, values, t)
        return f"tensor {name} as type {t}"
    # a tensor dropped, renamed or reshaped
    i = rng.randrange(len(tensors))
    name, values, t = tensors[i]
    op = rng.randrange(3)
    if op == 0:
        del tensors[i]
        return f"tensor {name} dropped"
    if op == 1:
        tensors[i] = (name + "x", values, t)
        return f"tensor {name} renamed"
    import numpy as np

    flat = np.asarray(values).reshape(-1)
    tensors[i] = (name, flat[: max(32, flat.size // 2 // 32 * 32)].reshape(-1, 32) if flat.size >= 64 else flat, t)
    return f"tensor {name} reshaped"


def _put_int(buf: bytearray, pos: int, value: int, width: int) -> None:
    if 0 <= pos <= len(buf) - width:
        buf[pos:pos + width] = (value % (1 << (8 * width))).to_bytes(width, "little")


def _fix_blm(buf: bytearray, base: Base, data_fix: bool) -> None:
    if data_fix:
        for off, n, entry in base.tensors:
            if off + n <= len(buf) and entry + 16 <= len(buf):
                struct.pack_into("<I", buf, entry + 12, zlib.crc32(bytes(buf[off:off + n])))
    if len(buf) >= 64:
        (header_size,) = struct.unpack_from("<Q", buf, 16)
        end = min(64 + header_size, len(buf))
        struct.pack_into("<I", buf, 52, zlib.crc32(bytes(buf[56:end]), zlib.crc32(bytes(buf[:52]) + b"\0\0\0\0")))


def mutate(rng: random.Random, base: Base, out: Path) -> str:
    """Writes a mutation of base to out; returns what was done."""
    if base.rebuild is not None and rng.random() < 0.3:
        try:
            return "rebuilt: " + base.rebuild(rng, out)
        except Exception:  # noqa: BLE001 - a change the test writer cannot encode (a type it cannot quantize
            pass           # to, a block size the shape does not fit): mutate bytes instead
    buf = bytearray(base.path.read_bytes())
    header = (0, max(base.data_offset, 1))
    region = rng.choices([header, (0, len(buf)), (base.data_offset, len(buf))], weights=(6, 2, 1))[0]
    if region[1] <= region[0]:
        region = header

    def pos() -> int:  # a position in the region that is still in the (maybe truncated) file
        hi = min(region[1], len(buf))
        return rng.randrange(region[0], hi) if hi > region[0] else rng.randrange(max(len(buf), 1))

    what = []
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        op = rng.randrange(7 if base.fields else 6)
        if op == 0:
            p = pos()
            if p < len(buf):
                buf[p] ^= 1 << rng.randrange(8)
            what.append(f"bit flip at {p}")
        elif op == 1:
            width = rng.choice((1, 2, 4, 8))
            p = pos()
            if rng.random() < 0.5:
                p -= p % width
            v = rng.choice(INTERESTING)
            _put_int(buf, p, v, width)
            what.append(f"int{8 * width} {v} at {p}")
        elif op == 2:
            p = pos()
            if p < len(buf):
                buf[p] = rng.randrange(256)
            what.append(f"byte at {p}")
        elif op == 3:
            n = rng.randrange(0, len(buf))
            if rng.random() < 0.7:
                n = rng.randrange(0, header[1] + 64)
            del buf[n:]
            what.append(f"truncated to {n}")
        elif op == 4:
            extra = rng.randrange(1, 4096)
            buf += os.urandom(extra) if rng.random() < 0.5 else bytes(extra)
            what.append(f"{extra} bytes appended")
        elif op == 5 and len(buf) > 2:
            a, b = rng.randrange(len(buf)), rng.randrange(len(buf))
            n = rng.randrange(1, 64)
            buf[b:b + n] = buf[a:a + n]
            what.append(f"{n} bytes from {a} copied to {b}")
        elif op == 6:
            name = rng.choice(list(base.fields))
            width = 4 if name.endswith((".type", ".n_dims", "elem_type", "version", "magic")) else rng.choice((4, 8))
            v = rng.choice(INTERESTING)
            _put_int(buf, base.fields[name], v, width)
            what.append(f"{name} = {v}")
    if base.kind == "blm" and rng.random() < 0.5:
        data_fix = region[0] >= base.data_offset or rng.random() < 0.3
        _fix_blm(buf, base, data_fix)
        what.append("checksums fixed" if data_fix else "header checksum fixed")
    out.write_bytes(bytes(buf))
    return ", ".join(what)


# --- running a case ---------------------------------------------------------------------------------------

def run_case(path: Path, engines: tuple[str, ...], convert: bool) -> tuple[str, str]:
    """In the child: every engine loads the file and generates; the worst outcome and its message."""
    import barellm
    from barellm.errors import BarellmError

    warnings.simplefilter("ignore")
    os.environ["BARELLM_CONVERT"] = "1" if convert else "0"
    worst, detail = "ok", ""
    for engine in engines:
        try:
            model = barellm.load(str(path), engine=engine, context=64, threads=1)
            model.generate("Hello world", max_tokens=4, temperature=0)
            model.chat([{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
            model.detokenize(model.tokenize("a b <|im_start|>"))
        except BarellmError as e:
            if worst == "ok":
                worst, detail = "clean", f"{engine}: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - what the campaign looks for
            import traceback

            tb = traceback.extract_tb(e.__traceback__)[-1]
            return "other", f"{engine}: {type(e).__name__}: {e} (at {Path(tb.filename).name}:{tb.lineno})"
    return worst, detail


def in_child(fn: Callable[[], tuple[str, str]], timeout: float, mem_limit: int) -> tuple[str, str]:
    """fn() in a forked child, under a time and an address-space limit: (outcome, detail)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            os.close(r)
            resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001
                result = ("other", f"{type(e).__name__}: {e}")
            os.write(w, json.dumps([result[0], result[1][:2000]]).encode())
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "hang", f"still running after {timeout:g} s"
            ready, _, _ = select.select([r], [], [], left)
            if ready:
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "crash", f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    try:
        outcome, detail = json.loads(data)
        return outcome, detail
    except ValueError:
        return "other", f"the child exited with status {os.WEXITSTATUS(status)} and no result"


# --- the campaign --------------------------------------------------------------------------------------

@dataclass
class Campaign:
    counts: Counter = field(default_factory=Counter)
    by_base: dict[str, Counter] = field(default_factory=dict)
    finds: list[dict] = field(default_factory=list)
    clean_kinds: Counter = field(default_factory=Counter)  # which errors the clean cases ended in
    seconds: float = 0.0
    slowest: tuple[float, str] = (0.0, "")


def _kind(detail: str) -> str:
    """A clean error's message with the file, the numbers and the quoted names taken out: its kind."""
    msg = detail.split(": ", 2)[-1]
    msg = re.sub(r"^\S*(\.gguf|\.blm|/case\d+\S*):? ", "", msg)
    msg = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", msg)
    return re.sub(r"0x[0-9a-f]+|-?\d+(\.\d+)?", "N", msg)[:90]


def run(n: int, seed: int, bases: list[Base], engines: tuple[str, ...], timeout: float, mem_limit: int,
        save: Path | None, progress: bool) -> Campaign:
    c = Campaign()
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="barellm-fuzz-"))
    try:
        for k in range(n):
            rng = random.Random(f"{seed}:{k}")
            base = bases[k % len(bases)]
            case = work / f"case{k}.{base.kind}"
            what = mutate(rng, base, case)
            convert = base.kind == "gguf" and rng.random() < 0.5 and case.stat().st_size < 16 << 20
            home = work / "home"
            os.environ["BARELLM_HOME"] = str(home)
            t = time.perf_counter()
            outcome, detail = in_child(lambda case=case, convert=convert: run_case(case, engines, convert),
                                       timeout, mem_limit)
            dt = time.perf_counter() - t
            if dt > c.slowest[0]:
                c.slowest = (dt, f"case {k} ({base.name}: {what})")
            c.counts[outcome] += 1
            if outcome == "clean":
                c.clean_kinds[_kind(detail)] += 1
            c.by_base.setdefault(base.name, Counter())[outcome] += 1
            if outcome in ("crash", "hang", "other"):
                find = {"case": k, "seed": seed, "base": base.name, "mutation": what, "converted": convert,
                        "outcome": outcome, "detail": detail}
                c.finds.append(find)
                if save is not None:
                    save.mkdir(parents=True, exist_ok=True)
                    kept = save / f"seed{seed}-case{k}-{outcome}.{base.kind}"
                    shutil.copyfile(case, kept)
                    find["file"] = str(kept)
                if progress:
                    print(f"case {k}: {outcome}: {detail[:300]} [{base.name}: {what[:200]}]", file=sys.stderr)
            case.unlink(missing_ok=True)
            shutil.rmtree(home / "blm", ignore_errors=True)  # what the case converted
            if progress and (k + 1) % 100 == 0:
                counts = " ".join(f"{o} {c.counts[o]}" for o in OUTCOMES)
                print(f"{k + 1}/{n} in {time.perf_counter() - t0:.0f} s: {counts}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    c.seconds = time.perf_counter() - t0
    return c


def _warm_up(path: Path, home: Path) -> None:
    """Imports, in this process, what every child needs, and fills the caches a load fills (the tokenizer's
    Unicode tables): each forked child then starts from them instead of compiling and computing them again.
    Only the reference engine runs here: the native one starts threads, which a fork does not carry."""
    import barellm
    import barellm.runtime.engine  # noqa: F401
    from barellm.text.sandbox import environment  # noqa: F401

    os.environ["BARELLM_HOME"] = str(home)
    warnings.simplefilter("ignore")
    barellm.load(str(path), engine="reference", context=16).generate("Hi", max_tokens=1, temperature=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--cases", type=int, default=200, help="mutations to run (default 200)")
    ap.add_argument("--seed", type=int, default=0, help="case k of a seed is the same mutation every time")
    ap.add_argument("--models", default="tiny", help="tiny, smollm, or both comma-separated (default tiny)")
    ap.add_argument("--engines", default="native,reference", help="default native,reference")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds a case may take (default 30)")
    ap.add_argument("--mem-limit", type=float, default=6.0, help="GiB of address space a case may take")
    ap.add_argument("--save", type=Path, default=None, help="keep the input of every crash, hang and other here")
    ap.add_argument("--replay", type=Path, default=None, help="run one saved file instead, and print its outcome")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    engines = tuple(e for e in args.engines.split(",") if e)
    mem_limit = int(args.mem_limit * (1 << 30))
    if args.replay is not None:
        os.environ.setdefault("BARELLM_HOME", tempfile.mkdtemp(prefix="barellm-fuzz-home-"))
        convert = args.replay.suffix == ".gguf"
        print(*in_child(lambda: run_case(args.replay, engines, convert), args.timeout, mem_limit), sep=": ")
        return 0

    workdir = Path(tempfile.mkdtemp(prefix="barellm-fuzz-bases-"))
    os.environ["BARELLM_HOME"] = str(workdir / "home")
    try:
        bases: list[Base] = []
        models = args.models.split(",")
        if "tiny" in models:
            bases += tiny_bases(workdir)
        if "smollm" in models:
            os.environ.pop("BARELLM_HOME")  # the real cache holds the model and its conversion
            bases += smollm_bases()
        _warm_up(bases[0].path, workdir / "warm")
        c = run(args.cases, args.seed, bases, engines, args.timeout, mem_limit, args.save, progress=not args.json)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = {"cases": args.cases, "seed": args.seed, "models": args.models, "engines": list(engines),
              "seconds": round(c.seconds, 1), "counts": {o: c.counts[o] for o in OUTCOMES},
              "by_base": {b: dict(v) for b, v in c.by_base.items()}, "finds": c.finds,
              "clean_kinds": dict(c.clean_kinds.most_common(40)),
              "slowest": {"seconds": round(c.slowest[0], 2), "case": c.slowest[1]}}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{args.cases} cases of seed {args.seed} ({args.models}; engines {', '.join(engines)}) in "
              f"{c.seconds:.0f} s: " + ", ".join(f"{o} {c.counts[o]}" for o in OUTCOMES))
        for b, v in c.by_base.items():
            print(f"  {b}: " + ", ".join(f"{o} {v[o]}" for o in OUTCOMES if v[o]))
        print(f"  slowest case: {c.slowest[0]:.2f} s, {c.slowest[1][:200]}")
        print("  most frequent clean errors:")
        for kind, n in c.clean_kinds.most_common(15):
            print(f"    {n:6d}  {kind}")
    return 1 if any(c.counts[o] for o in ("crash", "hang", "other")) else 0


if __name__ == "__main__":
    sys.exit(main())
