"""minillm's own constrained decoding: a regular expression compiled to a byte-level DFA, and the token mask of each
of its states — the course's implementation of the matcher protocol that ``sampling.guided.mask_logits`` reads
(``GuidedDecodingParams(regex=..., backend="minillm")``; xgrammar's matchers are the other implementation).

How it works.  ``compile_regex`` parses a small regex subset into a Thompson NFA over **bytes** (a non-ASCII
literal becomes its UTF-8 bytes) and turns it into a DFA by subset construction: ``table[s, b]`` is the state after
byte ``b`` from ``s``; state 0 is dead (absorbing, and also every state from which no accepting state can be
reached).  A token is its byte string (``vocabulary_bytes``), so a token is allowed in state ``s`` iff feeding its
bytes one by one never reaches state 0 (``token_mask``, exercise 9.5 of the course: every token walked at once,
column by column); an end-of-sequence token is allowed iff ``s`` accepts.  The mask of a state is computed the
first time a matcher reaches it and cached on the compiled regex, shared by every request with the same regex.

The subset: literals (``\\`` escapes any punctuation; ``\\n``, ``\\t``), ``.`` (any ASCII character but newline),
classes ``[a-z0-9_]`` and ``[^...]`` (ASCII only), ``\\d``, ``\\w``, ``\\s``, groups ``( )`` / ``(?: )``,
alternation ``|``, ``?``, ``*``, ``+``, ``{m}``, ``{m,}``, ``{m,n}``; a leading ``^`` and a trailing ``$`` are
accepted (the whole output must match anyway).  Anything else raises ``ValueError`` naming the position.

Cost: compiling is one pass over the pattern and 256 byte transitions per DFA state; a state's mask is at most L
(the longest token's bytes) vectorised gathers over the tokens still alive — once per state, then a dict lookup.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch import Tensor

# The fix named by every "the minillm backend cannot take this" error, for both callers: the Python API's field
# and the server's per-request field.
USE_XGRAMMAR = ("use the xgrammar backend (GuidedDecodingParams(backend='xgrammar'), or the request field "
                "guided_decoding_backend='xgrammar')")

DEAD = 0  # the DFA's dead state: every transition from it returns to it
MAX_DFA_STATES = 4096
MAX_REPEAT = 256  # the largest m or n of {m,n}


# ------------------------------------------------------------------------------------------------ parsing
_CLASS_ESCAPES = {
    "d": set(range(ord("0"), ord("9") + 1)),
    "w": set(range(ord("0"), ord("9") + 1)) | set(range(ord("a"), ord("z") + 1))
         | set(range(ord("A"), ord("Z") + 1)) | {ord("_")},
    "s": {ord(c) for c in " \t\n\r\f\v"},
}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
_ASCII = set(range(128))


class _Parser:
    """Recursive descent over the pattern -> an AST of tuples: ("bytes", set), ("cat", [..]), ("alt", [..]),
    ("rep", node, m, n or None)."""

    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"guided_decoding.regex {self.p!r} at position {self.i}: {what} (the minillm backend "
                          "reads literals, ., [...], \\d \\w \\s, ( ), |, ?, *, +, {m,n}; "
                          f"{USE_XGRAMMAR} for more)")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def parse(self):
        if self.peek() == "^":
            self.i += 1
        node = self.alternation()
        if self.peek() == "$" and self.i == len(self.p) - 1:
            self.i += 1
        if self.i != len(self.p):
            raise self.error(f"unexpected {self.p[self.i]!r}")
        return node

    def alternation(self):
        branches = [self.concatenation()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.concatenation())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def concatenation(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "$" and self.i == len(self.p) - 1:
                break
            items.append(self.repetition())
        return ("cat", items)

    def repetition(self):
        node = self.atom()
        while self.peek() in ("?", "*", "+", "{"):
            c = self.peek()
            self.i += 1
            if c == "?":
                node = ("rep", node, 0, 1)
            elif c == "*":
                node = ("rep", node, 0, None)
            elif c == "+":
                node = ("rep", node, 1, None)
            else:
                end = self.p.find("}", self.i)
                body = self.p[self.i : end] if end >= 0 else ""
                lo, sep, hi = body.partition(",")
                if end < 0 or not lo.isdigit() or (hi and not hi.isdigit()):
                    raise self.error("expected {m}, {m,} or {m,n}")
                m, n = int(lo), (int(hi) if hi else None) if sep else int(lo)
                if (n is not None and n < m) or max(m, n or 0) > MAX_REPEAT:
                    raise self.error(f"bad repeat {{{body}}} (need m <= n <= {MAX_REPEAT})")
                self.i = end + 1
                node = ("rep", node, m, n)
        return node

    def atom(self):
        c = self.peek()
        if c is None:
            raise self.error("pattern ends where an atom was expected")
        self.i += 1
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ')'")
            self.i += 1
            return node
        if c == "[":
            return ("bytes", self.char_class())
        if c == ".":
            return ("bytes", _ASCII - {ord("\n")})
        if c == "\\":
            return self.escape(in_class=False)
        if c in "?*+{":
            raise self.error(f"nothing to repeat before {c!r}")
        if c in ")]}^$":
            raise self.error(f"unexpected {c!r}")
        return ("cat", [("bytes", {b}) for b in c.encode()])  # a non-ASCII character is several bytes

    def escape(self, in_class: bool):
        c = self.peek()
        if c is None:
            raise self.error("pattern ends after '\\'")
        self.i += 1
        if c in _CLASS_ESCAPES:
            return ("bytes", set(_CLASS_ESCAPES[c]))
        if c in _CHAR_ESCAPES:
            return ("bytes", {ord(_CHAR_ESCAPES[c])})
        if c.isascii() and not c.isalnum():
            return ("bytes", {ord(c)})
        raise self.error(f"unsupported escape \\{c}")

    def char_class(self) -> set[int]:
        negate = self.peek() == "^"
        self.i += negate
        members: set[int] = set()
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("missing ']'")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            self.i += 1
            if c == "\\":
                members |= self.escape(in_class=True)[1]
                continue
            if not c.isascii():
                raise self.error(f"non-ASCII {c!r} in a class (write it as a literal or an alternation)")
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                hi = self.p[self.i + 1]
                if not hi.isascii() or hi < c:
                    raise self.error(f"bad range {c}-{hi}")
                members |= set(range(ord(c), ord(hi) + 1))
                self.i += 2
            else:
                members.add(ord(c))
        return (_ASCII - members) if negate else members


# ------------------------------------------------------------------------------------------------ automata
@dataclass
class _NFA:
    eps: list[list[int]] = field(default_factory=list)
    edges: list[list[tuple[frozenset, int]]] = field(default_factory=list)

    def node(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, ast) -> tuple[int, int]:
        """Thompson's construction: (entry, exit) nodes of the fragment for ``ast``."""
        kind = ast[0]
        if kind == "bytes":
            a, b = self.node(), self.node()
            self.edges[a].append((frozenset(ast[1]), b))
            return a, b
        if kind == "cat":
            a = cur = self.node()
            for item in ast[1]:
                s, e = self.build(item)
                self.eps[cur].append(s)
                cur = e
            return a, cur
        if kind == "alt":
            a, b = self.node(), self.node()
            for branch in ast[1]:
                s, e = self.build(branch)
                self.eps[a].append(s)
                self.eps[e].append(b)
            return a, b
        _, sub, m, n = ast  # "rep": m copies, then n - m optional ones (or a loop)
        a = cur = self.node()
        for _ in range(m):
            s, e = self.build(sub)
            self.eps[cur].append(s)
            cur = e
        if n is None:
            s, e = self.build(sub)
            self.eps[cur].append(s)
            self.eps[e].append(cur)
        else:
            end = self.node()
            for _ in range(n - m):
                s, e = self.build(sub)
                self.eps[cur].append(s)
                self.eps[cur].append(end)
                cur = e
            self.eps[cur].append(end)
            cur = end
        return a, cur

    def closure(self, nodes) -> frozenset:
        seen, stack = set(nodes), list(nodes)
        while stack:
            for t in self.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)


@dataclass(frozen=True)
class ByteDFA:
    """A DFA over bytes.  ``table``: int64 [S, 256], the state after each byte; state ``DEAD`` (0) is absorbing and
    every state that cannot reach an accepting one is merged into it; ``accepting``: bool [S]; ``start``: the
    initial state (``DEAD`` only for a pattern that matches nothing)."""

    pattern: str
    table: Tensor
    accepting: Tensor
    start: int

    @property
    def num_states(self) -> int:
        return self.table.shape[0]

    def walk(self, state: int, data: bytes) -> int:
        """The state after ``data`` from ``state`` (``DEAD`` once dead).  Plain Python, one step per byte."""
        for b in data:
            state = int(self.table[state, b])
            if state == DEAD:
                break
        return state


def compile_regex(pattern: str) -> ByteDFA:
    """Parse ``pattern`` (the module's subset) and build its byte DFA.  Raises ``ValueError`` naming the position
    for a pattern outside the subset, or one whose DFA would exceed ``MAX_DFA_STATES``."""
    if not isinstance(pattern, str):
        raise ValueError(f"guided_decoding.regex must be a string, got {pattern!r}")
    nfa = _NFA()
    entry, exit_ = nfa.build(_Parser(pattern).parse())
    start = nfa.closure([entry])
    ids, order, rows = {start: 1}, [start], []
    while len(rows) < len(order):
        current = order[len(rows)]
        row = [DEAD] * 256
        by_byte: dict[int, set[int]] = {}
        for node in current:
            for allowed, target in nfa.edges[node]:
                for b in allowed:
                    by_byte.setdefault(b, set()).add(target)
        for b, targets in by_byte.items():
            nxt = nfa.closure(targets)
            if nxt not in ids:
                if len(order) >= MAX_DFA_STATES:
                    raise ValueError(f"guided_decoding.regex {pattern!r} needs more than {MAX_DFA_STATES} DFA "
                                     f"states; simplify it or {USE_XGRAMMAR}")
                ids[nxt] = len(order) + 1
                order.append(nxt)
            row[b] = ids[nxt]
        rows.append(row)
    table = torch.tensor([[DEAD] * 256] + rows, dtype=torch.int64)
    accepting = torch.tensor([False] + [exit_ in s for s in order])
    # merge the states that cannot reach an accepting one into DEAD (walk the transitions backwards)
    alive = accepting.clone()
    while True:
        grown = alive | alive[table].any(dim=1)
        grown[DEAD] = False
        if torch.equal(grown, alive):
            break
        alive = grown
    table = torch.where(alive[table], table, torch.full_like(table, DEAD))
    table[~alive] = DEAD
    return ByteDFA(pattern, table, accepting & alive, 1 if bool(alive[1]) else DEAD)


# ------------------------------------------------------------------------------------------------ tokens
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable stand-in character of each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def vocabulary_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """Each token id's bytes, or None for ids that never spell text (special tokens, ids past the tokenizer's
    vocabulary up to the LM head's ``vocab_size``).  Reads byte-level BPE (GPT-2, Llama 3, SmolLM) and
    SentencePiece-style vocabularies (``▁`` for a space, ``<0x0A>`` byte fallback)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))
    special = set(tokenizer.all_special_ids) | {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                                                 if getattr(t, "special", False)}
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except AttributeError:  # a slow tokenizer: no serialised pipeline
        decoder = {}
    byte_level = decoder.get("type") == "ByteLevel"
    alphabet = _byte_level_decoder()
    to_latin1 = str.maketrans({c: chr(b) for c, b in alphabet.items()})  # stand-in char -> the char of its byte
    out: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            out.append(None)
        elif byte_level and all(c in alphabet for c in piece):
            out.append(piece.translate(to_latin1).encode("latin-1"))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("▁", " ").encode())
    return out + [None] * (vocab_size - len(out))


def pad_vocabulary(vocab: list[bytes | None]) -> tuple[Tensor, Tensor]:
    """The token table ``token_mask`` walks: (uint8 [V, L] each token's bytes, zero-padded to the longest token L;
    int64 [V] lengths, 0 for a token that is never allowed)."""
    lengths = torch.tensor([len(b) if b else 0 for b in vocab], dtype=torch.int64)
    width = max(int(lengths.max()), 1) if len(vocab) else 1
    packed = bytearray(b"".join((b or b"").ljust(width, b"\0") for b in vocab))
    return torch.frombuffer(packed, dtype=torch.uint8).reshape(len(vocab), width).clone(), lengths


def token_mask(table: Tensor, state: int, token_bytes: Tensor, lengths: Tensor) -> Tensor:
    """Which tokens keep the DFA alive from ``state``: token t is allowed iff walking its bytes
    ``token_bytes[t, :lengths[t]]`` one at a time through ``table`` never reaches ``DEAD`` (0); a token of length
    0 is never allowed (it would not advance the output).

    table: int64 [S, 256], ``table[s, b]`` the state after byte b from state s (``DEAD`` absorbing);
    token_bytes: uint8 [V, L], zero-padded (the padding bytes are not part of the token); lengths: int64 [V].
    -> bool [V].  Cost: at most L gathers, each over the tokens still walking — vectorised over the vocabulary.
    """
    ### BEGIN SOLUTION
    states = torch.full(lengths.shape, state, dtype=table.dtype)
    for i in range(token_bytes.shape[1]):
        walking = torch.nonzero((lengths > i) & (states != DEAD)).squeeze(1)  # tokens with a byte at column i
        if walking.numel() == 0:
            break
        states[walking] = table[states[walking], token_bytes[walking, i].long()]
    return (states != DEAD) & (lengths > 0)
    ### END SOLUTION


def reference_token_mask(dfa: ByteDFA, state: int, vocab: list[bytes | None]) -> Tensor:
    """The plain twin of ``token_mask``: each token's bytes walked alone, in Python.  -> bool [V].  One Python step
    per byte of the vocabulary: for tests."""
    return torch.tensor([bool(b) and dfa.walk(state, b) != DEAD for b in vocab], dtype=torch.bool)


# ------------------------------------------------------------------------------------------------ matchers
class CompiledRegex:
    """One regex for one vocabulary: its DFA, the token table and the per-state masks (computed on first use with
    ``mask_fn``, cached, shared by every matcher of the regex).  ``stop_token_ids``: the ids allowed (only) where
    the DFA accepts."""

    def __init__(self, dfa: ByteDFA, vocab: list[bytes | None], token_bytes: Tensor, lengths: Tensor,
                 stop_token_ids: list[int], mask_fn=None):
        self.dfa, self.vocab, self.token_bytes, self.lengths = dfa, vocab, token_bytes, lengths
        self.stop_token_ids = frozenset(stop_token_ids)
        self.mask_fn = mask_fn
        self._masks: dict[int, Tensor] = {}

    def mask(self, state: int) -> Tensor:
        """bool [V]: the tokens allowed in ``state`` (cached per state)."""
        if state not in self._masks:
            fn = self.mask_fn if self.mask_fn is not None else token_mask  # looked up now: swappable
            allowed = fn(self.dfa.table, state, self.token_bytes, self.lengths).clone()
            stops = torch.tensor(sorted(self.stop_token_ids), dtype=torch.int64)
            allowed[stops] = bool(self.dfa.accepting[state])
            self._masks[state] = allowed
        return self._masks[state]


class RegexTokenMatcher:
    """The matcher protocol of ``sampling.guided.mask_logits`` for one sample of a regex-constrained request:
    ``allowed_tokens()`` (bool [V]), ``accept_token(id) -> bool``, ``is_terminated()``, ``reset()``,
    ``rollback(n)``.  A stop token is accepted where the DFA accepts, and terminates the matcher."""

    def __init__(self, compiled: CompiledRegex):
        self.compiled = compiled
        self.reset()

    def reset(self) -> None:
        self.state, self.terminated, self._history = self.compiled.dfa.start, False, []

    def allowed_tokens(self) -> Tensor:
        """bool [V]: the tokens that keep the output a prefix of a match (stop tokens where it is a match)."""
        if self.terminated:
            return torch.zeros_like(self.compiled.lengths, dtype=torch.bool)
        return self.compiled.mask(self.state)

    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) if the regex does not allow it here."""
        c = self.compiled
        if self.terminated or not 0 <= token < len(c.vocab):
            return False
        if token in c.stop_token_ids:
            if not bool(c.dfa.accepting[self.state]):
                return False
            self._history.append(self.state)
            self.terminated = True
            return True
        data = c.vocab[token]
        nxt = c.dfa.walk(self.state, data) if data else DEAD
        if nxt == DEAD:
            return False
        self._history.append(self.state)
        self.state = nxt
        return True

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        for _ in range(n):
            self.state, self.terminated = self._history.pop(), False

    def is_terminated(self) -> bool:
        return self.terminated


class RegexCompiler:
    """Compiles regexes for one tokenizer and LM head (``vocab_size``; ids past the tokenizer's are never allowed)
    into ``CompiledRegex`` (cached per pattern) and makes a request's matchers.  ``mask_fn``: the per-state mask
    function (default ``token_mask``)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], mask_fn=None):
        self.vocab = vocabulary_bytes(tokenizer, vocab_size)
        self.token_bytes, self.lengths = pad_vocabulary(self.vocab)
        self.stop_token_ids = list(stop_token_ids)
        self.mask_fn = mask_fn
        self._cache: dict[str, CompiledRegex] = {}

    def compile(self, pattern: str) -> CompiledRegex:
        """-> the pattern's ``CompiledRegex`` (cached); ``ValueError`` for a pattern outside the subset or one that
        admits no output (the start state's mask is computed here to know)."""
        if pattern not in self._cache:
            dfa = compile_regex(pattern)
            compiled = CompiledRegex(dfa, self.vocab, self.token_bytes, self.lengths, self.stop_token_ids,
                                     self.mask_fn)
            if dfa.start == DEAD or not bool(compiled.mask(dfa.start).any()):
                raise ValueError(f"guided_decoding.regex {pattern!r} admits no output with this model's vocabulary")
            self._cache[pattern] = compiled
        compiled = self._cache[pattern]
        if compiled.mask_fn is not self.mask_fn:  # a new mask function: the cached masks were not its own
            compiled.mask_fn, compiled._masks = self.mask_fn, {}
        return compiled

    def matchers(self, pattern: str, n: int) -> list[RegexTokenMatcher]:
        """``n`` fresh matchers, one per sample."""
        compiled = self.compile(pattern)
        return [RegexTokenMatcher(compiled) for _ in range(n)]
