"""Which replica should serve a request: the one that holds its prompt's prefix, else the least loaded.

Each replica's scheduler keeps the KV cache of its recent sequences (one per slot) and reuses the longest
common prefix of a new prompt, so a chat's next turn is cheap only on the replica that served the turn
before. The router cannot see those caches; it remembers what it sent where. A prompt is summarized by
digests of its prefixes at natural boundaries: the end of each chat message (a chat's next turn repeats
the earlier messages exactly), and every BLOCK_CHARS characters inside long text (a long shared document
or system prompt). A request whose longest remembered prefix is at least min_prefix_chars goes to the
replica that holds it, unless that replica already has more than `slack` requests more in flight than
the least loaded one; anything else goes to the least loaded replica.

Nothing here knows Ray: the deployments feed it replica names and load, and it answers with a name.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

BLOCK_CHARS = 256
DEFAULT_MIN_PREFIX_CHARS = 128   # ~30 tokens: below this, re-prefilling elsewhere costs little

Key = tuple[int, bytes]   # (characters of the prompt this prefix covers, digest of those characters)

# application name -> the names of its running replicas, as the platform's request router in this process
# knows them (set by that router when it starts)
LIVE_REPLICAS: dict[str, Callable[[], list[str]]] = {}


def _prompt_pieces(path: str, body: dict[str, Any]) -> list[str]:
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return []
        # one piece per message, in a canonical form, so equal messages give equal pieces however the
        # client spelled the JSON
        return [json.dumps(m, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n" for m in messages]
    if path.endswith("/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return ["".join(f"{t}," for t in prompt)]
    return []


def route_keys(path: str, body: bytes) -> list[Key]:
    """The prefix digests of a generation request's prompt, shortest first ([] for anything else,
    malformed bodies included: the replica will answer those with the proper error)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return []
    if not isinstance(obj, dict):
        return []
    h = hashlib.blake2b(digest_size=16)
    keys: list[Key] = []
    n = 0
    for piece in _prompt_pieces(path, obj):
        for start in range(0, len(piece), BLOCK_CHARS):
            chunk = piece[start:start + BLOCK_CHARS]
            h.update(chunk.encode("utf-8", errors="surrogatepass"))
            n += len(chunk)
            keys.append((n, h.copy().digest()))
    return keys


@dataclass
class Choice:
    replica: str | None   # None: no replica is known yet (let the platform pick)
    matched_chars: int    # how much of the prompt the chosen replica is believed to hold
    reason: str           # "prefix" or "least_loaded"


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

    def choose(self, keys: Sequence[Key], exclude: Iterable[str | None] = ()) -> Choice:
        excluded = set(exclude)
        candidates = [r for r in self.inflight if r not in excluded]
        if not candidates:
            return Choice(None, 0, "least_loaded")
        least = min(self.inflight[r] for r in candidates)
        if keys:
            near = [r for r in candidates if self.inflight[r] <= least + self.slack]
            scored = [(self.matched(r, keys), -self.inflight[r], self.rng.random(), r) for r in near]
            n, _, _, best = max(scored)
            if n >= self.min_prefix_chars:
                return Choice(best, n, "prefix")
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
