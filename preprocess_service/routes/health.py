"""Operations: liveness, readiness, Prometheus metrics (no auth)."""

from __future__ import annotations

import os
import shutil
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from preprocess_service.deps import MetricsDep, PreflightDep, SettingsDep, StoreDep, SupervisorDep
from preprocess_service.handlers import problem
from preprocess_service.metrics import CONTENT_TYPE
from preprocess_service.schemas import PROBLEM_RESPONSES, Health, problem_body

router = APIRouter(tags=["ops"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """Liveness: the process answers (no auth)."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: PROBLEM_RESPONSES[503]})
def readyz(settings: SettingsDep, store: StoreDep, supervisor: SupervisorDep, preflight: PreflightDep):
    """Readiness: database reachable, cache dir writable with at least min_free_bytes free, a warm worker and a
    preflight sandbox (no auth). 503 (problem+json, Retry-After) with every check's result otherwise."""
    checks: dict[str, Any] = {}
    try:
        store.query("SELECT 1")
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    checks["cache_dir_writable"] = os.access(settings.cache_dir, os.W_OK)
    try:
        checks["free_bytes"] = shutil.disk_usage(settings.cache_dir).free
    except OSError as exc:
        checks["free_bytes"] = f"error: {exc}"
    checks["min_free_bytes"] = settings.min_free_bytes
    live = supervisor.live_pids()
    try:
        ready = store.ready_worker_pids() & live if checks["database"] == "ok" else set()
    except Exception:
        ready = set()
    checks["workers_alive"], checks["workers_ready"] = len(live), len(ready)
    checks["preflight_ready"] = preflight.ready()
    enough_space = isinstance(checks["free_bytes"], int) and checks["free_bytes"] >= settings.min_free_bytes
    ok = (checks["database"] == "ok" and checks["cache_dir_writable"] and enough_space and ready
          and checks["preflight_ready"] > 0)
    if not ok:
        return problem(503, problem_body(503, "Service Unavailable", f"not ready: {checks}", kind="not-ready",
                                         instance="/readyz"), {"Retry-After": "2"})
    return Health(status="ready", checks=checks)


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(service_metrics: MetricsDep) -> PlainTextResponse:
    """Prometheus text format: jobs by state, rows and tokens tokenized, job durations, request latency per route."""
    return PlainTextResponse(service_metrics.render(), media_type=CONTENT_TYPE)
