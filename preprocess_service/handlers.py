"""Exception handlers: every error the service answers is ``application/problem+json`` (RFC 9457), with the field
it concerns and one sentence saying what to do."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from preprocess_service.faults import classify, fault_classes
from preprocess_service.schemas import (
    PROBLEM_JSON,
    DatasetRequest,
    MixtureRequest,
    MixtureRule,
    MixtureSourceSpec,
    PretokenizeOptions,
    SourceSpec,
    problem_body,
)
from preprocess_service.security import ServiceError

logger = logging.getLogger("preprocess_service")

_MODELS_AT = {("",): DatasetRequest, ("source",): SourceSpec, ("options",): PretokenizeOptions}
_MIXTURE_MODELS_AT = {("",): MixtureRequest, ("mixture",): MixtureRule}  # sources.N.* : see _model_at


def problem(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    """A problem+json response."""
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def _title(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _model_at(where: list[str], mixture: bool):
    """The request model whose fields an unknown field sits among (for the "allowed here" hint)."""
    if not mixture:
        return _MODELS_AT.get(tuple(where[:-1]) or ("",))
    if len(where) >= 3 and where[0] == "sources":  # sources.<i>.<field> / sources.<i>.source.<field> / ...options
        inner = tuple(where[2:-1])
        return {(): MixtureSourceSpec, ("source",): SourceSpec, ("options",): PretokenizeOptions}.get(inner)
    return _MIXTURE_MODELS_AT.get(tuple(where[:-1]) or ("",))


def validation_message(err: dict[str, Any], mixture: bool = False) -> dict[str, str]:
    """``{field, message}`` of one pydantic error, the message saying how to fix it."""
    where = [str(x) for x in err.get("loc", ())]
    if where and where[0] == "body":
        where = where[1:]
    kind, msg, given = err.get("type", ""), err.get("msg", "invalid"), err.get("input")
    field = "body" if kind == "json_invalid" else (".".join(where) or "body")
    if kind == "missing":
        text = f"{field}: required field is missing; add it"
    elif kind == "extra_forbidden":
        model = _model_at(where, mixture)
        allowed = ", ".join(model.model_fields) if model else "see /openapi.json"
        text = f"{field}: unknown field; remove it (allowed here: {allowed})"
    elif kind == "json_invalid":
        text = (f"body: not valid JSON ({err.get('ctx', {}).get('error', msg)}); send a JSON object with "
                "Content-Type: application/json")
    elif kind in ("model_attributes_type", "dict_type", "model_type"):
        text = f"{field}: must be a JSON object, got {type(given).__name__}"
    elif kind == "value_error":
        text = f"{field}: {msg.removeprefix('Value error, ')}"
    else:
        scalar = isinstance(given, (str, int, float, bool, type(None)))
        shown = json.dumps(given)[:80] if scalar else type(given).__name__
        text = f"{field}: {msg} (got {shown})"
    return {"field": field, "message": text}


async def _service_error(request: Request, exc: ServiceError):
    return problem(exc.status, exc.body(request.url.path), exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError):
    errors = [validation_message(e, request.url.path == "/v1/mixtures") for e in exc.errors()]
    detail = f"{len(errors)} invalid field(s): " + "; ".join(e["message"] for e in errors)
    return problem(422, problem_body(422, "Unprocessable Content", detail, kind="validation",
                                     instance=request.url.path, errors=errors))


async def _http_error(request: Request, exc: StarletteHTTPException):
    if exc.status_code == 400 and "parsing the body" in str(exc.detail):  # e.g. bytes that are not UTF-8
        detail = ("body: not valid JSON (could not decode it); send a UTF-8 JSON object with Content-Type: "
                  "application/json")
        return problem(422, problem_body(422, "Unprocessable Content", detail, kind="validation",
                                         instance=request.url.path, errors=[{"field": "body", "message": detail}]))
    if exc.status_code == 404:
        detail = f"no route {request.method} {request.url.path}; the API is listed at /docs and /openapi.json"
        kind = "not-found"
    elif exc.status_code == 405:
        detail = f"method {request.method} is not allowed on {request.url.path}; see /openapi.json"
        kind = "method-not-allowed"
    else:
        detail, kind = str(exc.detail), "http-error"
    return problem(exc.status_code, problem_body(exc.status_code, _title(exc.status_code), detail, kind=kind,
                                                 instance=request.url.path), getattr(exc, "headers", None))


async def _machine_fault(request: Request, exc: Exception):
    """A full disk (507) or the database down (503), answered as handled errors (the connection stays
    usable); anything else of these classes goes on to the 500 handler."""
    fault = classify(exc, request.app.state.settings.cache_dir)
    if fault is None:
        raise exc
    logger.warning("%s %s: %s (%s: %s)", request.method, request.url.path, fault.detail, type(exc).__name__,
                   str(exc).splitlines()[0][:200] if str(exc) else "")
    return problem(fault.status, fault.body(request.url.path), fault.headers)


async def _internal_error(request: Request, exc: Exception):
    fault = classify(exc, request.app.state.settings.cache_dir)  # a full disk (507), the database down (503)
    if fault is not None:
        logger.warning("%s %s: %s (%s)", request.method, request.url.path, fault.detail, type(exc).__name__)
        return problem(fault.status, fault.body(request.url.path), fault.headers)
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return problem(500, problem_body(500, "Internal Server Error", f"internal error ({type(exc).__name__}); "
                                     "see the service log", kind="internal", instance=request.url.path))


def install_error_handlers(app: FastAPI) -> None:
    """Every error as problem+json: the service's own, validation (422), routing (404/405), machine faults, 500."""
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for fault_class in fault_classes():
        app.add_exception_handler(fault_class, _machine_fault)
    app.add_exception_handler(Exception, _internal_error)
