"""Structured output from a request's fields: OpenAI's ``response_format``, vLLM's ``guided_*`` extras and a chat
request's ``ToolPlan`` -> one ``GuidedDecodingParams`` (at most one of them may constrain a request).

    response_format={"type": "json_object"}                       any JSON object
    response_format={"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}
                                                                  JSON valid against the schema (strict or not:
                                                                  the output always follows it)
    response_format={"type": "text"} / None                       unconstrained
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's extras (schema, regex, list, EBNF)
    guided_decoding_backend="xgrammar" | "minillm"                who computes the masks (vLLM's per-request field;
                                                                  "minillm": the engine's regex DFA, regex only)
    structured_outputs={"json" | "regex" | "choice" | "grammar" | "json_object": ...}
                                                                  vLLM's current form of the guided_* extras
"""

from __future__ import annotations

from minillm.entrypoints.openai.tools import ToolPlan
from minillm.sampling.guided import BACKENDS, KINDS, GuidedDecodingParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# structured_outputs' options (vLLM's StructuredOutputsParams) with the values minillm honours as they are: its JSON
# grammars write no free whitespace (so either disable_any_whitespace is met) and keep the schema's
# additionalProperties; a whitespace_pattern or a structural_tag it cannot honour is a 400
STRUCTURED_OUTPUTS_OPTIONS = {"disable_any_whitespace": (True, False), "disable_fallback": (True, False),
                              "disable_additional_properties": (False,), "whitespace_pattern": (),
                              "structural_tag": ()}


class FieldError(ValueError):
    """A bad structured-output field: ``param`` is the request field to name in the 400."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def guided_decoding(body, plan: ToolPlan | None = None) -> tuple[GuidedDecodingParams | None, str | None]:
    """-> (the request's constraint, the field it came from) or (None, None).  Raises ``FieldError``.
    ``guided_decoding_backend`` picks the constraint's backend; without a constraint it asks for nothing (vLLM
    ignores it then) but an unknown name is still refused."""
    backend = getattr(body, "guided_decoding_backend", None)
    if backend is not None and backend not in BACKENDS:
        raise FieldError("guided_decoding_backend", f"guided_decoding_backend must be one of {', '.join(BACKENDS)} "
                                                    f"(or omitted: xgrammar), got {backend!r}")
    found = []
    rf = _response_format(body.response_format)
    if rf is not None:
        found.append(("response_format", rf))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, {kind: value}))
    so = _structured_outputs(getattr(body, "structured_outputs", None))
    if so is not None:
        found.append(("structured_outputs", so))
    if plan is not None and plan.schema() is not None:
        found.append(("tool_choice", {"json": plan.schema()}))
    if not found:
        return None, None
    if len(found) > 1:
        names = [f for f, _ in found]
        raise FieldError(names[1], f"{' and '.join(names)} each constrain the output: send only one of them")
    field, kwargs = found[0]
    try:
        return GuidedDecodingParams(**kwargs, backend=backend), field
    except ValueError as e:
        if "guided_decoding.backend" in str(e):  # a backend that cannot take this kind of constraint
            raise FieldError("guided_decoding_backend", f"guided_decoding_backend {backend!r} constrains "
                                                        f"guided_regex only, got {field}; omit it (xgrammar)") from e
        raise FieldError(field, f"{field}: {e}") from e


def _structured_outputs(so) -> dict | None:
    """vLLM's ``structured_outputs`` -> ``GuidedDecodingParams`` keyword arguments (None: absent).  Its constraint
    keys are ``GuidedDecodingParams``' own names; an option minillm cannot honour is a ``FieldError``."""
    if so is None:
        return None
    if not isinstance(so, dict):
        raise FieldError("structured_outputs", "structured_outputs must be an object such as {'regex': '...'} or "
                                               f"{{'json': {{schema}}}}, got {so!r}")
    for name, value in so.items():
        allowed = STRUCTURED_OUTPUTS_OPTIONS.get(name)
        if name in KINDS or value is None or (allowed is not None and value in allowed):
            continue
        what = (f"{name}={value!r} is not supported by minillm (accepted: {list(allowed) or 'null'})"
                if allowed is not None else f"unknown key {name!r} (constraints: {', '.join(KINDS)})")
        raise FieldError("structured_outputs", f"structured_outputs: {what}")
    return {k: so[k] for k in KINDS if so.get(k) is not None}


def _response_format(rf) -> dict | None:
    """``response_format`` -> ``GuidedDecodingParams`` keyword arguments (None: unconstrained)."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise FieldError("response_format", "response_format.json_schema must be {'name': ..., 'schema': "
                                                f"{{JSON schema}}, 'strict': true|false}}, got {spec!r}")
        if spec.get("strict") not in (None, True, False):
            raise FieldError("response_format", f"response_format.json_schema.strict must be true or false, got "
                                                f"{spec['strict']!r}")
        return {"json": spec["schema"]}
    raise FieldError("response_format", "response_format must be {'type': 'text' | 'json_object' | 'json_schema', "
                                        f"...}}, got {rf!r}")
