"""The command line's options, declared once: generated from the config dataclasses and their field docs.

As vLLM's ``engine/arg_utils.py``: a field of ``EngineConfig`` or ``SamplingParams`` *is* a flag.
``EngineConfig.max_num_seqs`` becomes ``--max-num-seqs``: its type from the annotation (``int | None`` parses as
int), its help from the string documenting the field, its choices from the constant the config validates against.
Booleans are ``--flag/--no-flag``.  ``ParallelConfig``'s fields are flattened (``--tensor-parallel-size``);
``speculative_config`` is one JSON object (``--speculative-config '{"method": "ngram"}'``).  A flag left out
parses as None, and None is never passed on: the config's own default applies, and a ``serve --replicas`` front
forwards to each replica exactly the options the user gave (``to_argv``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

from minillm.config import KV_CACHE_DTYPES, KV_EVICTIONS, POLICIES, PREEMPTION_MODES, EngineConfig, ParallelConfig
from minillm.dtypes import MODEL_DTYPES as DTYPES
from minillm.kernels.select import CHOICES as KERNEL_CHOICES
from minillm.models.loader import QUANTIZATIONS
from minillm.sampling.params import SamplingParams

# field name -> the constant its __post_init__ checks against
FIELD_CHOICES = {"policy": POLICIES, "preemption": PREEMPTION_MODES, "kv_cache_dtype": KV_CACHE_DTYPES,
                 "kv_eviction": KV_EVICTIONS}
# EngineConfig fields given as their own dataclass's fields, one flag each (vLLM's --tensor-parallel-size)
FLATTENED = {"parallel_config": ParallelConfig}


@dataclass(frozen=True)
class Option:
    """One flag: ``--dest-with-dashes``.  ``default`` is what argparse stores when the flag is absent (None for
    every config field: leave the config's default); ``shown_default`` is the default the help names."""

    dest: str
    help: str
    type: Callable[[str], Any] | None = str
    choices: tuple | None = None
    action: str | type[argparse.Action] = "store"
    default: Any = None
    shown_default: Any = None
    metavar: str | None = None
    parent: str | None = None  # the EngineConfig field this one is flattened from ("parallel_config")

    @property
    def flag(self) -> str:
        """``--max-num-seqs`` for ``max_num_seqs``."""
        return "--" + self.dest.replace("_", "-")

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: Any = None) -> None:
        """Add this flag to ``parser``; ``default`` overrides ``self.default`` (e.g. ``generate --max-tokens``)."""
        default = self.default if default is None else default
        shown = self.shown_default if default is None else default
        help_ = self.help + (" (repeatable)" if self.action == "append" else "")
        help_ += "" if shown is None else f" (default: {shown})"
        kwargs: dict[str, Any] = {"default": default, "help": help_.replace("%", "%%"), "action": self.action}
        if self.action in ("store", "append"):
            kwargs.update(type=self.type, choices=self.choices, metavar=self.metavar)
        parser.add_argument(self.flag, **kwargs)

    def to_argv(self, value: Any) -> list[str]:
        """The arguments that parse back to ``value`` ([] for None, the absent flag)."""
        if value is None:
            return []
        if self.action is argparse.BooleanOptionalAction:
            return [self.flag if value else "--no-" + self.flag[2:]]
        if self.action == "append":
            return [arg for item in value for arg in (self.flag, str(item))]
        return [self.flag, json.dumps(value) if isinstance(value, dict) else str(value)]


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of the dataclass ``cls``, whitespace collapsed: ``{name: doc}``."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def json_object(text: str) -> dict:
    """argparse type: a JSON object (``--speculative-config '{"method": "ngram"}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


def dataclass_options(cls: type, *, skip: Iterable[str] = (), parent: str | None = None) -> tuple[Option, ...]:
    """One ``Option`` per field of ``cls`` (``FLATTENED`` fields expanded into their dataclass's options)."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    options: list[Option] = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.name in FLATTENED:
            options += dataclass_options(FLATTENED[f.name], parent=f.name)
            continue
        if f.name not in docs:
            raise TypeError(f"{cls.__name__}.{f.name} has no doc string under it: it is the flag's help")
        shown = None if f.default in (dataclasses.MISSING, ()) else f.default  # () : no stop strings
        help_ = docs[f.name].replace("``", "")  # reST literals read as plain text in a terminal
        options.append(Option(f.name, help_, shown_default=shown, choices=FIELD_CHOICES.get(f.name),
                              parent=parent, **_parse_as(cls, f.name, hints[f.name])))
    return tuple(options)


def _parse_as(cls: type, name: str, hint: Any) -> dict[str, Any]:
    """How a field's annotation reads from the command line: argparse's ``type`` / ``action`` / ``metavar``."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] if union else [hint]
    if bool in kinds:
        return {"type": None, "action": argparse.BooleanOptionalAction}
    if kinds[0] in (int, float, str):
        return {"type": kinds[0]}
    if typing.get_origin(kinds[0]) is tuple and typing.get_args(kinds[0]) in ((str, ...), (int, ...)):
        return {"type": typing.get_args(kinds[0])[0], "action": "append"}  # the flag repeated: one value each
    if dict in kinds or dict in map(typing.get_origin, kinds):
        return {"type": json_object, "metavar": "JSON"}
    raise TypeError(f"{cls.__name__}.{name}: no command-line form for {hint}")


@cache
def engine_options() -> tuple[Option, ...]:
    """Every ``EngineConfig`` field (``ParallelConfig``'s flattened in)."""
    return dataclass_options(EngineConfig)


@cache
def sampling_options() -> tuple[Option, ...]:
    """``SamplingParams``' fields but ``n`` (the command line streams one sample's text) and ``guided_decoding``
    (structured output is the server's ``response_format`` and the Python API's)."""
    return dataclass_options(SamplingParams, skip=("n", "guided_decoding"))


@cache
def model_options() -> tuple[Option, ...]:
    """``load_model``'s (and ``LLM``'s) model arguments, with the values ``load_model`` accepts."""
    # quantization is checked by load_model (check_quantization), not by argparse choices: a bad scheme is the
    # loader's ValueError, exit status 2 from main() like any other bad value
    return (
        Option("model", "hub id, local directory or .gguf (default: embedded SmolLM2-135M)"),
        Option("dtype", "the activations' dtype (default: the device's usual one, models.loader.choose_dtype)",
               choices=tuple(DTYPES)),
        Option("device", "cpu or cuda (default: cuda when present)"),
        Option("kernels", "which implementation runs each op (minillm.kernels.select)", choices=KERNEL_CHOICES,
               default="auto"),
        Option("quantization", f"weight-only: {' | '.join(QUANTIZATIONS)} (default: none; int4 on the default "
                               "model runs its own Q4_1 blocks)", metavar="{" + ",".join(QUANTIZATIONS) + "}"),
    )


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, options: Iterable[Option],
                defaults: dict[str, Any] | None = None) -> None:
    """Add each option to ``parser``; ``defaults`` overrides some by name."""
    for option in options:
        option.add_to(parser, (defaults or {}).get(option.dest))


def given(args: argparse.Namespace, options: Iterable[Option]) -> dict[str, Any]:
    """``{dest: value}`` of the options that were given (not None) in ``args``."""
    return {o.dest: getattr(args, o.dest) for o in options if getattr(args, o.dest) is not None}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` keyword arguments the user gave; flattened fields regrouped
    (``parallel_config=ParallelConfig(...)``)."""
    kwargs: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for option in engine_options():
        value = getattr(args, option.dest)
        if value is not None:
            (nested.setdefault(option.parent, {}) if option.parent else kwargs)[option.dest] = value
    kwargs.update({name: FLATTENED[name](**fields) for name, fields in nested.items()})
    return kwargs


def to_argv(args: argparse.Namespace, options: Iterable[Option]) -> list[str]:
    """The arguments that give ``options`` the values they have in ``args`` (those given only)."""
    return [arg for o in options for arg in o.to_argv(getattr(args, o.dest))]
