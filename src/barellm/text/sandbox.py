"""The Jinja environment chat templates run in: sandboxed, and bounded in time, size and memory.

A chat template comes from a downloaded model file and runs on every chat request, so it is untrusted
code. Jinja's immutable sandbox keeps it away from Python's internals and from mutating what it is given;
it does not stop it from running for hours or filling memory:

    {% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}    10^10 iterations
    {% for i in range(99999) %}{{ 'x' * 1000000 }}{% endfor %}                          100 GB of output
    {{ '{:>999999999}'.format('a') }}      {{ "%999999999d" % 1 }}                      1 GB in one step

Here every render gets a Budget (RenderLimits) and every way a template can spend time or memory draws
on it:

- time: a deadline, checked at every step;
- steps: each loop iteration, call, attribute look-up, operator, filter and output counts one;
- values: no string, list or number the template builds may exceed max_value characters or items.
  Where the size of a result can be known before it is built (repetition, padding, format widths and
  precisions, %-formats, replace, join, indent, JSON), it is checked first, so a refused value is never
  allocated. Containers count what they hold, shared parts as often as they appear, so that printing,
  comparing or serializing any value the template built costs at most that much;
- memory: the sizes of the strings and lists the template builds, and of the text it emits, are summed
  over the render and capped (a loop cannot pile up values that are each small enough);
- output: the rendered text is capped;
- nesting: for-loops may be nested at most max_nesting deep (checked when the template is compiled).

How: the sandbox's hooks (getattr, getitem, call, the binary and unary operators, str.format) are
overridden; every filter and test is wrapped; and the parsed template is rewritten before it is compiled,
so that each for-loop iterates through a counting iterator and charges the literal text of its body per
iteration, macro and call-block bodies charge theirs per call, `~` joins and list/tuple/dict literals are
measured, and each `{{ ... }}` is turned into text by a measuring finalize. An overrun raises
TemplateLimit, whose message is one line naming the bound.
"""

from __future__ import annotations

import contextvars
import itertools
import json
import re
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.filters import make_attrgetter
from jinja2.runtime import LoopContext, markup_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import _PassArg, pass_context
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

from barellm.text.limits import RenderLimits, TemplateLimit, TemplateRaised

__all__ = ["RenderLimits", "TemplateLimit", "TemplateRaised", "environment", "render"]


MAX_INT_BITS = 1 << 16  # an integer the template computes (9 ** 99999999 would take minutes and gigabytes)
MAX_DEPTH = 64          # containers inside one another
_MAX_INDENT = 64        # tojson/indent widths, join separators of tojson
_SLOW_INPUT = 1 << 18   # input of the filters that loop in Python over their input (wordwrap, urlize, pprint)
_CONTAINERS = (list, tuple, dict, set, frozenset)


class Budget:
    """What is left of one render's limits. Lives in a context variable for the length of the render."""

    __slots__ = ("limits", "deadline", "steps", "memory")

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.steps = 0
        self.memory = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise TemplateLimit(f"more than {self.limits.max_steps} steps (loop iterations, calls, look-ups)")
        self.tick()

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"rendering took longer than {self.limits.seconds:g} s")

    def charge(self, nbytes: int) -> None:
        self.memory += nbytes
        if self.memory > self.limits.max_memory:
            raise TemplateLimit(f"more than {self.limits.max_memory >> 20} MB of strings and lists built")

    def size(self, n: int, what: str) -> None:
        """Refuses a value of n characters or items before it is built."""
        if n > self.limits.max_value:
            raise TemplateLimit(f"{what} of {n} characters or items (at most {self.limits.max_value})")


_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("barellm_template_budget", default=None)


def _budget() -> Budget:
    b = _BUDGET.get()
    if b is None:
        # Jinja evaluates constant expressions while compiling; a RuntimeError there makes it leave them
        # for the render, where the budget applies.
        raise RuntimeError("chat templates are evaluated only while rendering")
    return b


# --- measuring values ------------------------------------------------------------------------------------

def measure(value: Any, limit: int) -> int:
    """The logical size of a value: characters of a string; items of a container plus the sizes of what
    it holds, a part held twice counted twice (the cost of printing, comparing or serializing it).
    Raises TemplateLimit past limit, or for containers nested deeper than MAX_DEPTH. Shared parts are
    walked once, so the walk is linear in the distinct containers however large the size."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if not isinstance(value, _CONTAINERS):
        return 1
    memo: dict[int, int] = {}

    def walk(v: Any, depth: int) -> int:
        known = memo.get(id(v))
        if known is not None:
            return known
        if depth > MAX_DEPTH:
            raise TemplateLimit(f"a value nested more than {MAX_DEPTH} deep")
        total = len(v)
        for x in (itertools.chain.from_iterable(v.items()) if isinstance(v, dict) else v):
            if isinstance(x, (str, bytes)):
                total += len(x)
            elif isinstance(x, _CONTAINERS):
                total += walk(x, depth + 1)
            if total > limit:
                raise TemplateLimit(f"a value of more than {limit} characters or items")
        memo[id(v)] = total
        return total

    return walk(value, 0)


def made(b: Budget, value: Any) -> Any:
    """A value the template just built: held to max_value and charged to memory. Iterators come back
    counting their items as steps."""
    if isinstance(value, (str, bytes)):
        if len(value) > b.limits.max_value:
            raise TemplateLimit(f"a value of {len(value)} characters (at most {b.limits.max_value})")
        b.charge(sys.getsizeof(value))
    elif isinstance(value, _CONTAINERS):
        measure(value, b.limits.max_value)
        b.charge(sys.getsizeof(value))
    elif isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"an integer of more than {MAX_INT_BITS} bits")
    elif isinstance(value, Iterator) and not isinstance(value, LoopContext):
        return counted(b, value)
    return value


def counted(b: Budget, iterable: Iterable[Any]) -> Iterator[Any]:
    """iterable, each item a step."""
    for x in iterable:
        b.step()
        yield x


def text(b: Budget, value: Any) -> str:
    """str(value), measured first when printing it could be large (a container's repr)."""
    if isinstance(value, str):
        return value
    if isinstance(value, _CONTAINERS):
        measure(value, b.limits.max_value)
    s = str(value)
    if len(s) > 10 * b.limits.max_value + 2:  # a repr escapes a character into at most 10
        raise TemplateLimit(f"a value printed as {len(s)} characters")
    return s


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _arg(args: tuple, kwargs: Mapping[str, Any], i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


# --- size checks made before an operation builds its result -------------------------------------------

_SPEC_NUMBER = re.compile(r"\d+")


def _check_spec(b: Budget, spec: str) -> None:
    """A str.format spec's width and precision (the only numbers a spec holds)."""
    for m in _SPEC_NUMBER.finditer(spec):
        digits = m.group()
        if len(digits) > 9 or int(digits) > b.limits.max_value:
            raise TemplateLimit(f"format width or precision {digits[:12]} (at most {b.limits.max_value})")


_PERCENT = re.compile(r"%(?:\((?P<key>[^()]*)\))?[-#0 +]*(?P<width>\*|\d+)?(?:\.(?P<prec>\*|\d*))?[hlL]?(?P<conv>.?)",
                      re.S)


def _percent_size(b: Budget, fmt: str, args: Any) -> int:
    """An upper bound of len(fmt % args), computed from the conversions without building anything."""
    lim = b.limits.max_value
    positional = list(args) if isinstance(args, tuple) else [args]
    pos = 0

    def next_arg() -> Any:
        nonlocal pos
        pos += 1
        return positional[pos - 1] if pos <= len(positional) else None

    def number(v: str | None) -> int:
        if v is None or v == "":
            return 0
        n = next_arg() if v == "*" else (int(v) if len(v) <= 9 else lim + 1)
        if not _int(n) or abs(n) > lim:
            raise TemplateLimit(f"%-format width or precision {str(n)[:12]} (at most {lim})")
        return abs(n)

    total = len(fmt)
    for m in _PERCENT.finditer(fmt):
        conv = m.group("conv")
        if conv == "%":
            continue
        if conv not in "diouxXeEfFgGcrsa" or not conv:
            raise TemplateLimit(f"%-format conversion {m.group()!r} is not supported in a chat template")
        width, prec = number(m.group("width")), number(m.group("prec"))
        key = m.group("key")
        if key is not None:
            v = args.get(key) if isinstance(args, Mapping) else None
        else:
            v = next_arg()
        if conv in "sra":
            if isinstance(v, (str, bytes, *_CONTAINERS)):
                n = measure(v, lim)
            else:
                n = len(text(b, v)) if v is not None else 4
            if conv != "s" or not isinstance(v, str):
                n = 10 * n + 2
            if m.group("prec") is not None:
                n = min(n, prec)
        elif conv in "eEfFgG":
            n = 330 + prec
        elif conv == "c":
            n = 1
        else:
            n = (v.bit_length() // 3 + 2 if _int(v) else 330) + prec
        total += max(n, width)
        if total > lim:
            raise TemplateLimit(f"a %-formatted string of more than {lim} characters")
    return total


def check_binop(b: Budget, op: str, left: Any, right: Any) -> None:
    lim = b.limits.max_value
    if op == "*":
        for seq, k in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(k, int) and k > 0:
                b.size(measure(seq, lim) * k, "a repetition")
        if _int(left) and _int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"a product of more than {MAX_INT_BITS} bits")
    elif op == "**":
        if _int(left) and _int(right) and right > 0 and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
            raise TemplateLimit(f"a power of more than {MAX_INT_BITS} bits")
    elif op == "+":
        if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
            b.size(len(left) + len(right), "a joined string")
        elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            b.size(measure(left, lim) + measure(right, lim), "a joined list")
    elif op == "%" and isinstance(left, str):
        _percent_size(b, left, right)


def _check_replace(b: Budget, s: Any, old: Any, new: Any, count: Any) -> None:
    if not (isinstance(s, (str, bytes)) and type(old) is type(s) and type(new) is type(s)):
        return
    n = s.count(old) if old else len(s) + 1
    if _int(count) and count >= 0:
        n = min(n, count)
    b.size(len(s) + n * max(0, len(new) - len(old)), "a replaced string")


def check_builtin(b: Budget, fn: Any, args: tuple, kwargs: dict) -> tuple:
    """Checks a call of a built-in method (str.center, str.replace, str.join, int.to_bytes, ...) before
    it runs; returns the arguments to call it with."""
    lim = b.limits.max_value
    for a in itertools.chain(args, kwargs.values()):
        if _int(a) and abs(a) > lim:
            raise TemplateLimit(f"argument {str(a)[:12]} of {fn.__name__}() (at most {lim})")
    owner, name = getattr(fn, "__self__", None), fn.__name__
    if isinstance(owner, (str, bytes)):
        if name in ("translate", "maketrans"):
            raise SecurityError(f"{type(owner).__name__}.{name} is not allowed in a chat template")
        if name == "expandtabs":
            tab = _arg(args, kwargs, 0, "tabsize", 8)
            if _int(tab):
                b.size(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * max(tab, 0),
                       "an expanded string")
        elif name == "replace":
            _check_replace(b, owner, _arg(args, kwargs, 0, "old", None), _arg(args, kwargs, 1, "new", None),
                           _arg(args, kwargs, 2, "count", -1))
        elif name == "join" and args:
            items = list(args[0])
            size = sum(len(x) for x in items if isinstance(x, (str, bytes)))
            b.size(size + len(owner) * max(0, len(items) - 1), "a joined string")
            args = (items, *args[1:])
    return args


# --- str.format ------------------------------------------------------------------------------------------

class _Bounded:
    """str.format with each field's spec and the running length of the result checked."""

    budget: Budget
    length: int = 0

    def format_field(self, value: Any, format_spec: str) -> Any:
        b = self.budget
        b.step()
        _check_spec(b, format_spec)
        if isinstance(value, _CONTAINERS):
            value = text(b, value)
        out = super().format_field(value, format_spec)  # type: ignore[misc]
        self.length += len(out)
        b.size(self.length, "a formatted string")
        return out

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion is not None and isinstance(value, _CONTAINERS):
            measure(value, self.budget.limits.max_value)
        return super().convert_field(value, conversion)  # type: ignore[misc]


class _Formatter(_Bounded, SandboxedFormatter):
    pass


class _EscapeFormatter(_Bounded, SandboxedEscapeFormatter):
    pass


# --- filters and globals ------------------------------------------------------------------------------

def _check_filter(b: Budget, context: Any, name: str, args: tuple, kwargs: dict) -> tuple:
    """Checks a filter's arguments before it runs; may hand back materialized arguments."""
    lim = b.limits.max_value
    value = args[0] if args else None
    if name in _STRINGIFYING and isinstance(value, _CONTAINERS):
        measure(value, lim)
    if name in ("center", "batch", "slice", "truncate", "wordwrap"):
        for a in itertools.chain(args[1:], kwargs.values()):
            if _int(a) and abs(a) > lim:
                raise TemplateLimit(f"argument {str(a)[:12]} of the {name} filter (at most {lim})")
    if name == "indent":
        s = text(b, value)
        width = _arg(args, kwargs, 1, "width", 4)
        w = len(width) if isinstance(width, str) else width if _int(width) else 0
        b.size(len(s) + (s.count("\n") + 1) * max(w, 0), "an indented string")
    elif name == "replace":
        _check_replace(b, text(b, value), _arg(args, kwargs, 1, "old", None), _arg(args, kwargs, 2, "new", None),
                       _arg(args, kwargs, 3, "count", None))
    elif name == "format":
        _percent_size(b, text(b, value), kwargs or tuple(args[1:]))
    elif name == "wordwrap":
        s = text(b, value)
        if len(s) > _SLOW_INPUT:
            raise TemplateLimit(f"wordwrap of {len(s)} characters (at most {_SLOW_INPUT})")
        width = _arg(args, kwargs, 1, "width", 79)
        wrap = _arg(args, kwargs, 3, "wrapstring", None) or context.environment.newline_sequence
        if _int(width) and width > 0 and isinstance(wrap, str):
            b.size(len(s) + (len(s) // width + s.count("\n") + 1) * len(wrap), "a wrapped string")
    elif name in ("urlize", "pprint"):
        if measure(value, _SLOW_INPUT) > _SLOW_INPUT:
            raise TemplateLimit(f"{name} of more than {_SLOW_INPUT} characters")
    elif name == "join" and args:
        items = list(value) if value is not None else []
        attribute = _arg(args, kwargs, 2, "attribute", None)
        parts = items if attribute is None else [make_attrgetter(context.environment, attribute)(x) for x in items]
        sep = text(b, _arg(args, kwargs, 1, "d", ""))
        b.size(sum(len(text(b, p)) for p in parts) + len(sep) * max(0, len(parts) - 1), "a joined string")
        args = (items, *args[1:])
    return args


# filters that print their input (a container's repr) before working on it
_STRINGIFYING = frozenset(("string", "e", "escape", "forceescape", "upper", "lower", "title", "capitalize", "trim",
                           "striptags", "wordcount", "urlencode", "center", "indent", "truncate", "wordwrap",
                           "replace", "format", "urlize", "safe", "filesizeformat"))
# filters that hand back something their input already holds (not a new value)
_PASSTHROUGH = frozenset(("first", "last", "min", "max", "random", "default", "d", "attr"))


def _sum(context: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """sum() that adds step by step through the size checks when it concatenates strings or lists."""
    b = _budget()
    get = make_attrgetter(context.environment, attribute) if attribute is not None else None
    total = start
    for item in iterable:
        b.step()
        x = get(item) if get is not None else item
        check_binop(b, "+", total, x)
        total = total + x
    return total


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON, as HF gives them.
    # The encoder's incremental form is used so that the size is checked as the text is produced.
    b = _budget()
    width = len(indent) if isinstance(indent, str) else indent if _int(indent) else 0
    if width > _MAX_INDENT or (separators is not None and any(len(str(s)) > _MAX_INDENT for s in separators)):
        raise TemplateLimit(f"tojson indent or separators wider than {_MAX_INDENT}")
    enc = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    out, n = [], 0
    for chunk in enc.iterencode(x):
        n += len(chunk)
        if n > b.limits.max_value:
            raise TemplateLimit(f"tojson output of more than {b.limits.max_value} characters")
        b.tick()
        out.append(chunk)
    return "".join(out)


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(text(_budget(), message)[:1000])


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > 256:
        raise TemplateLimit("strftime_now takes a format string of at most 256 characters")
    return datetime.now().strftime(fmt)


def _wrap(name: str, func: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """A filter or test that counts as a step, has its arguments checked and its result measured."""
    pass_arg = _PassArg.from_obj(func)
    passthrough = kind == "test" or name in _PASSTHROUGH

    @pass_context
    def bounded(context: Any, *args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.step()
        if kind == "filter":
            args = _check_filter(b, context, name, args, kwargs)
            if name == "sum" and not isinstance(_arg(args, kwargs, 2, "start", 0), (int, float)):
                return made(b, _sum(context, *args, **kwargs))
        if pass_arg is _PassArg.context:
            result = func(context, *args, **kwargs)
        elif pass_arg is _PassArg.eval_context:
            result = func(context.eval_ctx, *args, **kwargs)
        elif pass_arg is _PassArg.environment:
            result = func(context.environment, *args, **kwargs)
        else:
            result = func(*args, **kwargs)
        return result if passthrough else made(b, result)

    bounded.__name__ = bounded.__qualname__ = name
    return bounded


# filters the rewritten template calls (a template may name them too; they only count and measure)

@pass_context
def _loop(context: Any, iterable: Any) -> Iterator[Any]:
    b = _budget()
    b.step()
    return counted(b, iterable)


@pass_context
def _charge(context: Any, nbytes: int) -> str:
    b = _budget()
    b.step()
    b.charge(nbytes)
    return ""


@pass_context
def _value(context: Any, value: Any) -> Any:
    b = _budget()
    b.step()
    return made(b, value)


@pass_context
def _concat(context: Any, items: list[Any]) -> str:
    b = _budget()
    b.step()
    parts = [text(b, x) for x in items]
    b.size(sum(map(len, parts)), "a ~ joined string")
    out = markup_join(parts) if context.eval_ctx.autoescape else "".join(parts)
    b.charge(sys.getsizeof(out))
    return out


@pass_context
def _finalize(context: Any, value: Any) -> str:
    b = _budget()
    b.step()
    s = text(b, value)
    b.charge(sys.getsizeof(s))
    return s


_INTERNAL_FILTERS = {"_bl_loop": _loop, "_bl_charge": _charge, "_bl_value": _value, "_bl_concat": _concat}


# --- rewriting the parsed template -----------------------------------------------------------------------

def _call_filter(node: nodes.Expr, name: str, lineno: int) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=lineno)


def _literal_size(body: list[nodes.Node]) -> int:
    """Characters of literal text a body emits each time it runs (bodies that run on their own, those of
    inner loops, macros and blocks, charge for themselves)."""
    total, stack = 0, list(body)
    while stack:
        n = stack.pop()
        if isinstance(n, nodes.TemplateData):
            total += len(n.data)
        elif isinstance(n, nodes.For):
            stack.extend(n.else_)
        elif not isinstance(n, (nodes.Macro, nodes.CallBlock, nodes.Block)):
            stack.extend(n.iter_child_nodes())
    return total


class _Bounds(NodeTransformer):
    def __init__(self, max_nesting: int) -> None:
        self.max_nesting = max_nesting
        self.depth = 0

    def _charging(self, body: list[nodes.Node], lineno: int) -> list[nodes.Node]:
        charge = nodes.ExprStmt(_call_filter(nodes.Const(_literal_size(body), lineno=lineno), "_bl_charge", lineno),
                                lineno=lineno)
        return [charge, *body]

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.depth += 1
        if self.depth > self.max_nesting:
            raise TemplateSyntaxError(f"for-loops nested more than {self.max_nesting} deep", node.lineno)
        node = self.generic_visit(node)
        self.depth -= 1
        node.iter = _call_filter(node.iter, "_bl_loop", node.lineno)
        node.body = self._charging(node.body, node.lineno)
        return node

    def _visit_body(self, node: Any) -> nodes.Node:
        node = self.generic_visit(node)
        node.body = self._charging(node.body, node.lineno)
        return node

    visit_Macro = visit_CallBlock = visit_Block = _visit_body

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return _call_filter(nodes.List(node.nodes, lineno=node.lineno), "_bl_concat", node.lineno)

    def _visit_literal(self, node: Any) -> nodes.Node:
        node = self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load":
            return node
        return _call_filter(node, "_bl_value", node.lineno)

    visit_List = visit_Tuple = visit_Dict = _visit_literal


# --- the environment ------------------------------------------------------------------------------------

class GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: HF marks assistant text for training masks with it; for
    rendering it is transparent, but templates that use it must still parse."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(("+", "-", "*", "/", "//", "%", "**"))
    intercepted_unops = frozenset(("+", "-"))

    def __init__(self, limits: RenderLimits) -> None:
        # HF's settings: blocks eat their trailing newline and leading indentation; the template's own final
        # newline is dropped (keep_trailing_newline stays False); break/continue are allowed.
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                         extensions=[jinja2.ext.loopcontrols, GenerationTag])
        self.limits = limits
        self.filters["tojson"] = _tojson
        self.filters = {name: _wrap(name, f, "filter") for name, f in self.filters.items()}
        self.filters.update(_INTERNAL_FILTERS)
        self.tests = {name: _wrap(name, f, "test") for name, f in self.tests.items()}
        del self.globals["lipsum"]  # lorem ipsum of any length; no chat template needs it
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        tree = _Bounds(self.limits.max_nesting).visit(tree)
        tree.set_environment(self)
        return tree

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja's default hands back an Undefined that prints as "", so a probe like {{ x.__class__ }}
        # would pass silently; a template that reaches for internals is hostile and should say so.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        b = _budget()
        b.step()
        value = super().getitem(obj, argument)
        return made(b, value) if isinstance(argument, slice) else value

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        b.step()
        if operator == "+" and type(left) is str and type(right) is str:  # what templates do most, made quick
            b.size(len(left) + len(right), "a joined string")
            out = left + right
            b.charge(sys.getsizeof(out))
            return out
        check_binop(b, operator, left, right)
        return made(b, self.binop_table[operator](left, right))

    def call_unop(self, context: Any, operator: str, arg: Any) -> Any:
        _budget().step()
        return self.unop_table[operator](arg)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        b = _budget()
        b.step()
        if isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive for-loop
            args = (counted(b, args[0]), *args[1:])
        elif isinstance(__obj, types.BuiltinMethodType):
            args = check_builtin(b, __obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if getattr(__obj, "__name__", None) == "get":  # dict.get hands back what the dict holds
            return result
        return made(b, result)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if (not isinstance(value, (types.MethodType, types.BuiltinMethodType))
                or value.__name__ not in ("format", "format_map") or not isinstance(value.__self__, str)):
            return None
        fmt: str = value.__self__
        is_map = value.__name__ == "format_map"

        def bounded_format(*args: Any, **kwargs: Any) -> str:
            b = _budget()
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            f = _EscapeFormatter(self, escape=fmt.escape) if isinstance(fmt, Markup) else _Formatter(self)
            f.budget = b
            return made(b, type(fmt)(f.vformat(fmt, args, kwargs)))

        return bounded_format


def environment(limits: RenderLimits) -> BoundedSandbox:
    return BoundedSandbox(limits)


def render(template: jinja2.Template, variables: dict[str, Any], limits: RenderLimits) -> str:
    """The template's text for variables, within limits (TemplateLimit past them)."""
    b = Budget(limits)
    token = _BUDGET.set(b)
    gen = template.generate(**variables)
    try:
        out, n = [], 0
        for chunk in gen:
            n += len(chunk)
            if n > limits.max_output:
                raise TemplateLimit(f"output of more than {limits.max_output} characters")
            b.tick()
            out.append(chunk)
        return "".join(out)
    finally:
        gen.close()
        _BUDGET.reset(token)
