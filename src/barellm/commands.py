"""The everyday commands: run, chat, pull, list, info, convert, verify."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from barellm.errors import BarellmError, FormatError, InvalidRequest


def register(sub: argparse._SubParsersAction) -> None:
    from barellm.arguments import add_model_args, add_sampling_args

    p = sub.add_parser("run", help="generate a continuation of a prompt, streamed to stdout",
                       description="Streams the continuation of PROMPT. MODEL defaults to smollm2-135m; "
                                   "PROMPT '-' reads it from stdin.")
    p.add_argument("words", nargs="+", metavar="[MODEL] PROMPT")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    p.add_argument("-v", "--verbose", action="store_true", help="print timings to stderr")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive chat that keeps the history and applies the template",
                       description="Chat with a model. Lines starting with / are commands: /reset, /exit.")
    p.add_argument("model", nargs="?", default=None, help="model name or path (default smollm2-135m)")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.add_argument("--template", default=None, help="a built-in chat template to use instead of the file's")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("pull", help="fetch a model by name into the cache")
    p.add_argument("names", nargs="+", metavar="MODEL")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", help="models known by name, and which are cached")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("info", help="CPU features found and the kernel path in use")
    p.set_defaults(func=cmd_info)

    _register_convert(sub)


def _load(args: argparse.Namespace, model: str | None, **kw: object):
    import barellm

    return barellm.load(model, threads=args.threads, context=args.context,
                        engine=getattr(args, "engine", "auto"), activations=getattr(args, "activations", "q8x2"),
                        **kw)


def cmd_run(args: argparse.Namespace) -> int:
    from barellm.arguments import sampling_kwargs

    if len(args.words) > 2:
        raise InvalidRequest("run takes [MODEL] PROMPT; quote the prompt")
    model_name, prompt = (args.words if len(args.words) == 2 else (None, args.words[0]))
    if prompt == "-":
        prompt = sys.stdin.read()
    t0 = time.perf_counter()
    model = _load(args, model_name)
    t_load = time.perf_counter() - t0
    kw = sampling_kwargs(args)
    source = model.chat_stream([{"role": "user", "content": prompt}], **kw) if args.chat else model.stream(prompt, **kw)
    n = 0
    t_first = None
    t0 = time.perf_counter()
    if not args.chat:
        sys.stdout.write(prompt)
    for piece in source:
        if t_first is None:
            t_first = time.perf_counter() - t0
        sys.stdout.write(piece)
        sys.stdout.flush()
        n += 1
    sys.stdout.write("\n")
    if args.verbose:
        dt = time.perf_counter() - t0
        print(f"[load {t_load:.2f} s, first token {t_first or 0:.3f} s, {n} pieces in {dt:.2f} s]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from barellm.arguments import sampling_kwargs

    model = _load(args, args.model, chat_template=args.template)
    kw = sampling_kwargs(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"{model.path.name} — /reset clears the history, /exit or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = messages[:1] if args.system else []
            print("(history cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        reply = ""
        for piece in model.chat_stream(messages, **kw):
            reply += piece
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from barellm import hub

    for name in args.names:
        path = hub.pull(name)
        print(path)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from barellm import hub
    from barellm.files import home

    cached = {m.name: m for m in hub.list_cached()}
    print(f"cache: {home()}")
    print(f"{'NAME':<16} {'SIZE':>9}  {'SHA256':<14} DESCRIPTION")
    for name, spec in sorted(hub.REGISTRY.items()):
        m = cached.get(name)
        size = f"{m.size / 1e6:.1f} MB" if m else "-"
        sha = m.sha256[:12] + "…" if m else "(not pulled)"
        print(f"{name:<16} {size:>9}  {sha:<14} {spec.description}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    try:
        from barellm import _native
    except ImportError as e:
        raise BarellmError(f"the native core is not built: {e}") from e
    from barellm import __version__
    from barellm.cpu import default_threads

    info = _native.cpu_info()
    print(f"barellm {__version__}")
    print(f"cpu avx2+fma+f16c: {'yes' if info['avx2_fma'] else 'no'}")
    print(f"kernel path: {info['isa']}  (BARELLM_ISA=scalar forces the portable path)")
    print(f"default threads: {default_threads()}")
    return 0
def _register_convert(sub: argparse._SubParsersAction) -> None:
    from barellm.convert import LAYOUT_CHOICES, TYPE_CHOICES

    p = sub.add_parser("convert", help="convert a .gguf file or a safetensors checkpoint into a .blm file",
                       description="Converts SRC (a .gguf file, a Hugging Face llama checkpoint directory, or a "
                                   "model name) into barellm's own format. The write is atomic.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("-o", "--output", required=True, metavar="OUT.blm")
    p.add_argument("--type", choices=TYPE_CHOICES, default=None,
                   help="store every 2-D weight in this type (default: keep the source's types)")
    p.add_argument("--layout", choices=LAYOUT_CHOICES, default="rows",
                   help="rows: GGUF's row layout (default); kernels: weight matrices repacked for the kernels")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("verify", help="check every checksum of a .blm file",
                       description="Checks a .blm file's header checksum and every tensor's CRC-32, and names any "
                                   "tensor that fails. A model name or a .gguf path checks its cached .blm.")
    p.add_argument("file", metavar="FILE")
    p.set_defaults(func=cmd_verify)


def cmd_convert(args: argparse.Namespace) -> int:
    from barellm import hub
    from barellm.convert import convert
    from barellm.formats import blm

    src = hub.resolve(args.src, pull_missing=False)
    out = Path(args.output)
    if out.exists() and out.is_dir():
        raise BarellmError(f"{out}: is a directory")
    convert(src, out, type=args.type, layout=args.layout, progress=False if args.quiet else None)
    with blm.BLMFile(out) as f:
        size = out.stat().st_size
        print(f"{out}: {len(f.tensors)} tensors, {size / 1e6:.1f} MB, from {src.name} "
              f"(sha256 {f.provenance['source.sha256'][:12]}…)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from barellm import hub
    from barellm.cache import cached_path
    from barellm.formats import blm, sniff
    from barellm.progress import Progress

    path = hub.resolve(args.file, pull_missing=False)
    if sniff(path) != "blm":
        cached = cached_path(path)
        if cached is None:
            raise FormatError(f"{path}: not a .blm file and not converted yet (GGUF files carry no checksums); "
                              "`barellm convert` it first")
        path = cached
    with Progress(path.stat().st_size, f"verifying {path.name}", enabled=sys.stderr.isatty()) as bar:
        r = blm.verify(path, bar)
    print(f"{path}: ok, header and {r.n_tensors} tensors ({r.nbytes / 1e6:.1f} MB) verified in {r.seconds:.2f} s")
    return 0
