"""Tool calls: OpenAI's ``tools`` / ``tool_choice`` as a grammar for the reply, and the reply back as ``tool_calls``.

    tool_choice={"type": "function", "function": {"name": "f"}}  the reply is f's arguments: JSON valid against
                                                                  f's ``parameters`` schema
    tool_choice="required"      the reply is a JSON array of calls ``[{"name": ..., "parameters": {...}}]`` (one
                                at least; one at most with ``parallel_tool_calls=false``), each name one of the
                                tools and its parameters valid against that tool's schema (vLLM's shape)
    tool_choice="auto"          (the default when tools are given) unconstrained text: a reply that is, as a whole,
                                one JSON call ``{"name": ..., "arguments" | "parameters": {...}}`` or an array of
                                them, naming given tools, becomes ``tool_calls``; any other reply is content.  (vLLM
                                needs a model-specific parser for "auto"; this is the model-agnostic rule.)
    tool_choice="none", or no tools: a plain reply.

The response then carries ``tool_calls`` (id, type "function", name, arguments as a JSON string) and
``finish_reason: "tool_calls"``; a stream carries them as ``delta.tool_calls`` (``tool_call_stream``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

from minillm.entrypoints.openai import protocol as p
from minillm.entrypoints.openai.sse import StreamMeta, chunk, event
from minillm.outputs import StepOutput


@dataclass(frozen=True)
class ToolPlan:
    """The tools a chat request offers (``functions``: OpenAI's ``function`` objects) and how the reply must use
    them: ``choice`` is "auto", "required" or the name of the one function to call."""

    functions: tuple[dict, ...]
    choice: str
    parallel: bool = True

    @property
    def named(self) -> dict | None:
        """The function ``tool_choice`` names, or None for "auto" / "required"."""
        return next((f for f in self.functions if f["name"] == self.choice), None)

    def schema(self) -> dict | None:
        """The JSON schema the reply is constrained to (None: "auto", unconstrained)."""
        if self.named is not None:
            return self.named.get("parameters") or {"type": "object"}
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"enum": [f["name"]]},
                                                   "parameters": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "parameters"]} for f in self.functions]
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}

    def parse(self, text: str) -> list[p.ToolCall]:
        """The tool calls a finished reply makes ([] when it makes none: it is content)."""
        if self.named is not None:
            return [_call(self.choice, text)]
        try:
            value = json.loads(text)
        except ValueError:
            return []
        calls = value if isinstance(value, list) else [value]
        names = {f["name"] for f in self.functions}
        out = []
        for c in calls:
            if not isinstance(c, dict) or c.get("name") not in names:
                return []
            args = c.get("parameters", c.get("arguments", {}))
            if not isinstance(args, dict):
                return []
            out.append(_call(c["name"], json.dumps(args)))
        return out


def _call(name: str, arguments: str) -> p.ToolCall:
    return p.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=p.FunctionCall(name=name, arguments=arguments))


def tool_plan(tools, tool_choice, parallel_tool_calls) -> ToolPlan | None:
    """A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` -> its ``ToolPlan``, or None when
    it calls no tools (no tools, or ``tool_choice="none"``).  Raises ``ValueError`` starting with the field's name."""
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, got {tools!r}")
    functions = []
    for i, t in enumerate(tools or []):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             f"{{JSON schema}}}}}}, got {t!r}")
        if not isinstance(f.get("parameters") or {}, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object, got {f['parameters']!r}")
        functions.append(f)
    if tool_choice is None and functions:  # OpenAI's default when tools are given
        tool_choice = "auto"
    if tool_choice in (None, "none") or not functions:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice {tool_choice!r} needs tools: pass tools=[...] or tool_choice='none'")
        return None
    if tool_choice in ("auto", "required"):
        choice = tool_choice
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        choice = tool_choice["function"].get("name")
        if choice not in {f["name"] for f in functions}:
            raise ValueError(f"tool_choice names the function {choice!r}, which is not one of the tools "
                             f"({', '.join(f['name'] for f in functions)})")
    else:
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {tool_choice!r}")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}")
    return ToolPlan(tuple(functions), choice, parallel_tool_calls is not False)


def finish_reason(calls: list, engine_reason: str | None) -> str | None:
    """"tool_calls" for a reply that ended normally with calls; the engine's reason otherwise."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


async def tool_call_stream(updates: AsyncIterable[StepOutput], meta: StreamMeta, plan: ToolPlan) -> AsyncIterator[str]:
    """``sse_stream`` for a chat request with a ``ToolPlan``: the role chunk per choice; then, for a named
    function, the call's id and name at once and its arguments as they are generated
    (``{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}``); for "auto" / "required" each choice's
    text is held until it ends and sent as all its calls at once (or as content, when it makes none); each choice
    ends with its finish_reason ("tool_calls" when it called); then usage (if asked) and ``[DONE]``."""
    for i in range(meta.num_choices):
        yield chunk(meta, [{"index": i, "delta": {"role": "assistant", "content": ""}}])
    held: dict[int, str] = {}
    opened: set[int] = set()
    completion_tokens = 0
    async for u in updates:
        completion_tokens += len(u.token_ids)
        if plan.named is not None:
            delta = {}
            if u.index not in opened:
                opened.add(u.index)
                call = _call(plan.choice, "")
                delta = {"tool_calls": [{"index": 0, "id": call.id, "type": "function",
                                         "function": {"name": plan.choice, "arguments": u.text}}]}
            elif u.text:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": u.text}}]}
            if delta or u.finish_reason is not None:
                yield chunk(meta, [{"index": u.index, "delta": delta,
                                    "finish_reason": finish_reason([1], u.finish_reason)}])
            continue
        held[u.index] = held.get(u.index, "") + u.text
        if u.finish_reason is None:
            continue
        calls = plan.parse(held[u.index])
        delta = ({"tool_calls": [{"index": k, **c.model_dump()} for k, c in enumerate(calls)]} if calls
                 else {"content": held[u.index]})
        yield chunk(meta, [{"index": u.index, "delta": delta, "finish_reason": finish_reason(calls, u.finish_reason)}])
    if meta.include_usage:
        yield chunk(meta, [], {"prompt_tokens": meta.prompt_tokens, "completion_tokens": completion_tokens,
                               "total_tokens": meta.prompt_tokens + completion_tokens})
    yield event("[DONE]")
