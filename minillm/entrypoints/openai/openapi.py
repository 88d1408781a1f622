"""The server's OpenAPI document, declaring the responses it really gives.

FastAPI documents every route with a body as answering 422 (its validation error); this server answers a bad
request 400 with OpenAI's error body instead, and refuses with 401/404/413/429/503 before or after validation.  The
document built here drops the 422 and its schemas and declares each error status a route can return, with the
error body's schema, so that a client generator or a conformance fuzzer (schemathesis) sees what it will get.
"""

from __future__ import annotations

from fastapi import FastAPI

from minillm.entrypoints.openai import protocol as p

# status -> when the server answers it (the description each route's document carries)
ERRORS = {
    400: "A bad value, malformed JSON or an unsupported field",
    401: "Missing or wrong API key ('Authorization: Bearer <key>')",
    404: "The model is not one this server serves",
    413: "The body is over the size limit, or the prompt over the model's context",
    429: "At capacity, or overloaded (with Retry-After)",
    503: "Shutting down, or the engine is unhealthy",
}
WITH_BODY = (400, 404, 413, 429, 503)  # what a request with a body can meet after the key
OTHER = {"/health": (503,)}  # routes without a body that refuse anyway


def declared_errors(path: str, operation: dict, api_key: bool) -> tuple[int, ...]:
    """The error statuses one operation can answer (the Gate's key check: ``/v1`` and every body)."""
    has_body = "requestBody" in operation
    codes = set(WITH_BODY if has_body else OTHER.get(path, ()))
    if api_key and (has_body or path.startswith("/v1")):
        codes.add(401)
    return tuple(sorted(codes))


def use_declared_errors(app: FastAPI, *, api_key: bool) -> None:
    """Make ``app.openapi()`` (and ``/openapi.json``) the document described above; built once, on first use."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            error = p.ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(error.pop("$defs", {}))
            schemas["ErrorResponse"] = error
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
            for path, operations in doc.get("paths", {}).items():
                for operation in operations.values():
                    responses = operation.setdefault("responses", {})
                    responses.pop("422", None)
                    for code in declared_errors(path, operation, api_key):
                        responses[str(code)] = {"description": ERRORS[code], "content": body}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
