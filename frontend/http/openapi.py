"""The OpenAPI document (``/openapi.json``) with every endpoint's request body schema.

Handlers read their bodies themselves (``app._serve``: size, depth and type checks in
one place), so FastAPI cannot see the bodies' models; this puts each model's JSON schema
back into the document, as the request body of its path. The document is what clients
generate code from, and what the suite's schema-driven fuzzer generates bodies from
(``benchmarks/serving/api_fuzz.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def request_schemas(bodies: dict[str, type[BaseModel]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(path -> a ``$ref`` to its body's schema, the schemas by name) for ``bodies``."""
    components: dict[str, Any] = {}
    refs: dict[str, Any] = {}
    for path, model in bodies.items():
        schema = model.model_json_schema(ref_template=_REF)
        named = {**schema.pop("$defs", {}), model.__name__: schema}
        for name, sub in named.items():
            # NOTE: two models of one name would share a schema; they must be one model.
            assert components.get(name, sub) == sub, f"two request models are named {name}"
            components[name] = sub
        refs[path] = {"$ref": _REF.format(model=model.__name__)}
    return refs, components


def with_request_bodies(
    app: FastAPI, bodies: dict[str, type[BaseModel]]
) -> Callable[[], dict[str, Any]]:
    """``app.openapi`` for an app whose POST ``bodies`` are read by hand."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            refs, components = request_schemas(bodies)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
            for path, ref in refs.items():
                content = {"application/json": {"schema": ref}}
                doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": content}
            app.openapi_schema = doc
        return app.openapi_schema

    return openapi
