"""Which replica should serve a request: the one that holds its prompt's prefix, else the least loaded.

Each replica's scheduler keeps the KV cache of its recent sequences (one per slot) and reuses the longest
common prefix of a new prompt, so a chat's next turn is cheap only on the replica that served the turn
before. The router cannot see those caches; it remembers what it sent where. A prompt is summarized by
digests of its prefixes at natural boundaries: the end of each chat message (a chat's next turn repeats
the earlier messages exactly), and every BLOCK_CHARS characters inside long text (a long shared document
or system prompt).

In order, for a request whose prompt is at least min_prefix_chars long (shorter ones go by load alone):
1. the replica this router remembers holding the longest prefix of it, if that prefix reaches past the
   conversation's anchor: the prefix up to its first user message (a chat's earlier turn, a repeated
   long prompt);
2. else the conversation's home: the replica its anchor hashes to (rendezvous hashing), the same on every
   router replica, so a chat that another router started still comes back to the replica holding it,
   while chats that share only a system prompt spread out;
3. else the least loaded replica.
A replica with more than `slack` requests in flight beyond the least loaded one is passed over in 1 and 2.

Nothing here knows Ray: the deployments feed it replica names and load, and it answers with a name.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

BLOCK_CHARS = 256
DEFAULT_MIN_PREFIX_CHARS = 128   # ~30 tokens: below this, re-prefilling elsewhere costs little

Key = tuple[int, bytes]   # (characters of the prompt this prefix covers, digest of those characters)

# application name -> the names of its running replicas, as the platform's request router in this process
# knows them (set by that router when it starts)
LIVE_REPLICAS: dict[str, Callable[[], list[str]]] = {}


@dataclass
class Route:
    """What the router needs of a request's prompt: its prefix digests, shortest first, and which of them
    identifies the conversation (None: nothing to route by)."""

    keys: list[Key] = field(default_factory=list)
    anchor: Key | None = None


def _prompt_pieces(path: str, body: dict[str, Any]) -> tuple[list[str], int]:
    """The prompt in pieces that later requests repeat exactly, and how many pieces make its anchor."""
    if path.endswith("/chat/completions") or path == "/api/chat":   # OpenAI's and Ollama's chat
        messages = body.get("messages")
        if not isinstance(messages, list):
            return [], 0
        # one piece per message, in a canonical form, so equal messages give equal pieces however the
        # client spelled the JSON
        pieces = [json.dumps(m, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n" for m in messages]
        first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                          len(messages) - 1)
        return pieces, first_user + 1
    if path.endswith("/completions") or path == "/api/generate":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return [prompt], 0
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return ["".join(f"{t}," for t in prompt)], 0
    return [], 0


def route_of(path: str, body: bytes) -> Route:
    """The Route of a generation request (empty for anything else, malformed bodies included: the replica
    will answer those with the proper error). A raw prompt's anchor is its first block."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return Route()
    if not isinstance(obj, dict):
        return Route()
    pieces, anchor_pieces = _prompt_pieces(path, obj)
    h = hashlib.blake2b(digest_size=16)
    route = Route()
    n = 0
    for i, piece in enumerate(pieces):
        for start in range(0, len(piece), BLOCK_CHARS):
            chunk = piece[start:start + BLOCK_CHARS]
            h.update(chunk.encode("utf-8", errors="surrogatepass"))
            n += len(chunk)
            route.keys.append((n, h.copy().digest()))
        if i + 1 == anchor_pieces:
            route.anchor = route.keys[-1]
    if route.keys and route.anchor is None:
        route.anchor = route.keys[0]
    return route


def rendezvous(anchor: bytes, replicas: Iterable[str]) -> str:
    """The replica an anchor hashes to: the same one on every router while it lives; when it goes, only
    its own conversations move."""
    return max(replicas, key=lambda r: hashlib.blake2b(anchor + r.encode(), digest_size=8).digest())


@dataclass
class Choice:
    replica: str | None   # None: no replica is known yet (let the platform pick)
    matched_chars: int    # how much of the prompt the chosen replica is believed to hold
    reason: str           # "prefix", "anchor" or "least_loaded"


class PrefixRouter:
    """Remembers, per replica, the prompts of its last `remembered` conversations, and counts the requests
    in flight to each. One event loop uses it; it takes no locks."""

    def __init__(self, *, min_prefix_chars: int = DEFAULT_MIN_PREFIX_CHARS, slack: int = 2, remembered: int = 4,
                 rng: random.Random | None = None) -> None:
        self.min_prefix_chars = min_prefix_chars
        self.slack = slack
        self.remembered = max(1, remembered)
        self.rng = rng or random.Random()
        self.inflight: dict[str, int] = {}
        # replica -> (last digest of a prompt -> every digest of that prompt), oldest first
        self.held: dict[str, OrderedDict[bytes, dict[bytes, int]]] = {}

    @property
    def replicas(self) -> list[str]:
        return list(self.inflight)

    def update(self, replicas: Iterable[str]) -> None:
        """The replicas alive now: new ones start empty, gone ones are forgotten."""
        alive = set(replicas)
        for r in alive - set(self.inflight):
            self.inflight[r] = 0
            self.held[r] = OrderedDict()
        for r in set(self.inflight) - alive:
            self.forget(r)

    def forget(self, replica: str) -> None:
        self.inflight.pop(replica, None)
        self.held.pop(replica, None)

    def matched(self, replica: str, keys: Sequence[Key]) -> int:
        """Characters of the longest prefix among keys that replica is believed to hold."""
        held = self.held.get(replica)
        if not held:
            return 0
        for n, digest in reversed(keys):
            if any(digest in prompt for prompt in held.values()):
                return n
        return 0

    def choose(self, route: Route, exclude: Iterable[str | None] = ()) -> Choice:
        excluded = set(exclude)
        candidates = [r for r in self.inflight if r not in excluded]
        if not candidates:
            return Choice(None, 0, "least_loaded")
        least = min(self.inflight[r] for r in candidates)
        keys = route.keys
        if keys and keys[-1][0] >= self.min_prefix_chars:
            near = [r for r in candidates if self.inflight[r] <= least + self.slack]
            scored = [(self.matched(r, keys), -self.inflight[r], self.rng.random(), r) for r in near]
            n, _, _, best = max(scored)
            # a remembered prefix wins if it covers the conversation's own start: a shared system prompt
            # alone would pull every chat to one replica, and other routers would not know
            if n >= max(self.min_prefix_chars, route.anchor[0] if route.anchor else 0):
                return Choice(best, n, "prefix")
            if route.anchor is not None:
                home = rendezvous(route.anchor[1], candidates)
                if home in near:
                    return Choice(home, self.matched(home, keys), "anchor")
        idle = [r for r in candidates if self.inflight[r] == least]
        best = self.rng.choice(idle)
        return Choice(best, self.matched(best, keys), "least_loaded")

    def begin(self, replica: str | None) -> None:
        if replica in self.inflight:
            self.inflight[replica] += 1

    def end(self, replica: str | None) -> None:
        if replica in self.inflight and self.inflight[replica] > 0:
            self.inflight[replica] -= 1

    def remember(self, replica: str, keys: Sequence[Key]) -> None:
        """replica now holds this prompt. A conversation that continues replaces its earlier turn (the
        replica's scheduler reuses that slot), and only the last `remembered` prompts are kept, as the
        replica has that many slots to keep them in."""
        if not keys:
            return
        if replica not in self.inflight:
            self.update([*self.inflight, replica])
        held = self.held[replica]
        digests = dict((d, n) for n, d in keys)
        for last in [last for last in held if last in digests]:
            del held[last]
        held[keys[-1][1]] = digests
        while len(held) > self.remembered:
            held.popitem(last=False)
