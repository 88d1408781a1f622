"""Structured output: a grammar decides which tokens may come next, and the sampler only sees those.

``GuidedDecodingParams`` (vLLM's shape) names the constraint: a JSON schema, any JSON object, a regular expression,
one of a list of strings, or an EBNF grammar.  ``GrammarCompiler`` turns it into xgrammar's compiled grammar
(once per constraint: compiled grammars are cached per (kind, spec); one ``TokenizerInfo`` per engine, built from
its tokenizer with the LM head's vocabulary size, so ids the tokenizer lacks are always masked).  Each sample of a
guided request gets its own ``GrammarMatcher``; every step ``mask_logits`` fills one int32 bitmask for all guided
rows at once (1 bit per vocabulary entry: V / 8 bytes a row) and sets the disallowed logits to -inf in place, and
the engine advances each matcher by the token committed.  Cost per step: one bitmask fill per guided row (a walk
of the grammar's stack over precomputed token sets) plus one masked write of the guided rows' logits [G, V].

xgrammar is imported on first use (the ``serve`` extra installs it): unconstrained requests never need it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import Tensor

from minillm.sampling.regex import USE_XGRAMMAR

KINDS = ("json", "regex", "choice", "grammar", "json_object")
BACKENDS = ("xgrammar", "minillm")  # minillm: the engine's own byte-level regex DFA (``sampling.regex``), regex only


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Exactly one constraint on the output (vLLM's ``GuidedDecodingParams`` names).  Invalid values raise
    ``ValueError`` naming the field; a constraint xgrammar cannot compile raises when the request is added.

    JSON is generated with fixed separators (", " and ": ", no other whitespace; xgrammar's
    ``any_whitespace=False``): a model may otherwise spend its token budget on spaces.  Object properties come in
    the schema's order.
    """

    json: dict | str | None = None
    """A JSON schema (a dict, or its JSON text) the output must validate against."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's / GBNF syntax, start rule ``root``) the output must derive from."""
    json_object: bool = False
    """The output is any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
    backend: str | None = None
    """Who computes the token masks: None or "xgrammar" (every kind), or "minillm" (``regex`` only: the engine's
    own regex DFA, ``sampling.regex``, whose per-state mask the course has students write)."""

    def __post_init__(self):
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"guided_decoding.backend must be one of {BACKENDS} (or None), got {self.backend!r}")
        given = [f.name for f in fields(self) if f.name != "backend" and getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"guided_decoding needs exactly one of json, regex, choice, grammar, json_object; got "
                             f"{given or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"guided_decoding.json is not valid JSON ({e}); pass a schema dict") from e
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"guided_decoding.json must be a JSON schema (an object), got {self.json!r}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not all(isinstance(c, str) for c in choice) or not choice:
                raise ValueError(f"guided_decoding.choice must be a non-empty list of strings, got {choice!r}")
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"guided_decoding.{name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"guided_decoding.json_object must be True or False, got {self.json_object!r}")
        if self.backend == "minillm" and self.kind != "regex":
            raise ValueError(f"guided_decoding.backend 'minillm' constrains regex only, got {self.kind}; "
                             f"{USE_XGRAMMAR}, the default")

    @property
    def kind(self) -> str:
        """Which constraint: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec as canonical text): equal constraints share one compiled grammar."""
        spec = getattr(self, self.kind)
        if self.kind == "json":
            spec = json.dumps(json.loads(spec) if isinstance(spec, str) else spec)  # key order matters: kept
        elif self.kind == "choice":
            spec = json.dumps(list(spec))
        return self.kind, str(spec)

    def __eq__(self, other) -> bool:
        return (isinstance(other, GuidedDecodingParams) and self.key == other.key
                and (self.backend or "xgrammar") == (other.backend or "xgrammar"))

    def __hash__(self) -> int:
        return hash((self.key, self.backend or "xgrammar"))


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("guided_decoding needs xgrammar: pip install 'minillm[serve]' (or xgrammar)") from e
    return xgrammar


class GrammarCompiler:
    """Compiles ``GuidedDecodingParams`` for one tokenizer and LM head, and makes the matchers of a request.

    ``tokenizer``: a Hugging Face tokenizer; ``vocab_size``: the LM head's V (may exceed the tokenizer's: the extra
    ids are never allowed); ``stop_token_ids``: the ids that end a reply (the engine's EOS ids) — the only tokens a
    completed grammar allows.  Building the ``TokenizerInfo`` reads the whole vocabulary once (a fraction of a
    second); each new constraint compiles once (milliseconds for small schemas) and is cached.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2):
        xgr = _import_xgrammar()
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self._cache: dict[tuple[str, str], object] = {}

    def compile(self, guided: GuidedDecodingParams):
        """-> xgrammar's ``CompiledGrammar`` (cached per ``guided.key``).  Raises ``ValueError`` naming the field
        for a constraint that does not compile (a bad regex or schema) or that admits no output at all."""
        key = guided.key
        if key not in self._cache:
            kind, spec = key
            try:
                compiled = {
                    "json": lambda: self._compiler.compile_json_schema(spec, any_whitespace=False),
                    "json_object": lambda: self._compiler.compile_json_schema('{"type": "object"}',
                                                                              any_whitespace=False),
                    "regex": lambda: self._compiler.compile_regex(spec),
                    "choice": lambda: self._compiler.compile_grammar(choice_grammar(guided.choice)),
                    "grammar": lambda: self._compiler.compile_grammar(spec),
                }[kind]()
            except Exception as e:  # noqa: BLE001 — xgrammar's parse / conversion errors: the constraint's fault
                reason = str(e).strip().splitlines()[-1].split(": ", 1)[-1]
                raise ValueError(f"guided_decoding.{kind} cannot be compiled: {reason}") from e
            self._check_satisfiable(kind, compiled)
            self._cache[key] = compiled
        return self._cache[key]

    def _check_satisfiable(self, kind: str, compiled) -> None:
        xgr = _import_xgrammar()
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        if not bitmask.any():
            raise ValueError(f"guided_decoding.{kind} admits no output with this model's vocabulary")

    def matchers(self, guided: GuidedDecodingParams, n: int) -> list:
        """``n`` fresh ``GrammarMatcher``s, one per sample (samples fork before their first token, so n fresh
        matchers are the fork of the parent's)."""
        xgr = _import_xgrammar()
        compiled = self.compile(guided)
        return [xgr.GrammarMatcher(compiled) for _ in range(n)]


def choice_grammar(choice: tuple[str, ...]) -> str:
    """The EBNF grammar whose language is exactly ``choice``: ``root ::= "a" | "b"`` (JSON string escapes, which
    xgrammar's EBNF literals read)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choice)


class TokenMatcher(Protocol):
    """What the engine needs of a sample's constraint besides xgrammar's ``GrammarMatcher``: its own mask.
    ``sampling.regex.RegexTokenMatcher`` is one; write another to plug any automaton into the engine."""

    def allowed_tokens(self) -> Tensor:
        """bool [V] (the LM head's V): the tokens allowed next."""

    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) if it is not allowed."""

    def is_terminated(self) -> bool:
        """True once a stop token was accepted in an accepting state: the sample ends."""

    def reset(self) -> None:
        """Back to the start state."""


def mask_logits(logits: Tensor, matchers: list) -> Tensor:
    """Set every token a row's grammar disallows to -inf; rows whose matcher is None are left alone.

    logits [R, V] fp32 on the CPU or a device (masked in place: pass the step's gathered rows, not a view the caller
    reuses unmasked) and R matchers -> the same tensor.  A matcher with ``allowed_tokens()`` (``TokenMatcher``)
    gives its bool [V] mask, applied in one masked write over those rows.  For xgrammar's matchers one bitmask
    [R, ceil(V / 32)] int32 is filled for all of them in one call (``BatchGrammarMatcher``), then applied in place
    by xgrammar's kernel (a C++ loop on the CPU, its CUDA kernel on a GPU) to those rows only: no copy of the rows
    and no unpacked [G, V] mask, so the apply reads V / 8 bytes and writes the disallowed logits of each row.
    """
    if logits.dim() != 2 or logits.shape[0] != len(matchers):
        raise ValueError(f"need logits [R, V] and R matchers; got {tuple(logits.shape)}, {len(matchers)}")
    own = [i for i, m in enumerate(matchers) if m is not None and hasattr(m, "allowed_tokens")]
    if own:
        allowed = torch.stack([matchers[i].allowed_tokens() for i in own]).to(logits.device)  # (G, V) bool
        index = torch.tensor(own, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    rows = [i for i, m in enumerate(matchers) if m is not None and not hasattr(m, "allowed_tokens")]
    if not rows:
        return logits
    xgr = _import_xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    xgr.BatchGrammarMatcher(max_threads=1).batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, rows)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1],
                                    indices=None if len(rows) == len(matchers) else rows)
    return logits


def reference_mask(matcher, vocab_size: int) -> Tensor:
    """The plain twin of one row's mask: token t is allowed iff the matcher accepts it (tried, then rolled back).
    -> bool [V].  V ``accept_token`` calls: for tests on tiny cases only."""
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    for t in range(vocab_size):
        if matcher.accept_token(t):
            allowed[t] = True
            matcher.rollback(1)
    return allowed
