"""FastAPI dependencies: what a route takes from the running service, set up by the lifespan
(:mod:`preprocess_service.lifespan`) on ``app.state``.

Routes declare ``settings: SettingsDep``, ``store: StoreDep``... instead of closing over ``create_app``'s locals;
a test can swap any of them with ``app.dependency_overrides``. Authentication stays a middleware
(:class:`preprocess_service.security.BearerAuthMiddleware`): it must answer 401 before a body is read and on
unknown routes, which a dependency (resolved after the body, for matched routes only) cannot.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from preprocess_service.integrity import DatasetIntegrity
from preprocess_service.jobs import Supervisor
from preprocess_service.metrics import ServiceMetrics
from preprocess_service.preflight import PreflightPool
from preprocess_service.settings import Settings
from preprocess_service.store import JobStore
from preprocess_service.submit import Submitter
from preprocess_service.views import DatasetViews


def state_dependency(name: str):
    """A dependency answering ``app.state.<name>`` (override it with ``app.dependency_overrides[get_<name>]``)."""

    def dependency(request: Request):
        return getattr(request.app.state, name)

    dependency.__name__ = f"get_{name}"
    return dependency


get_settings = state_dependency("settings")
get_store = state_dependency("store")
get_submitter = state_dependency("submitter")
get_supervisor = state_dependency("supervisor")
get_preflight = state_dependency("preflight")
get_integrity = state_dependency("integrity")
get_metrics = state_dependency("metrics")
get_views = state_dependency("views")

SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[JobStore, Depends(get_store)]
SubmitterDep = Annotated[Submitter, Depends(get_submitter)]
SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]
PreflightDep = Annotated[PreflightPool, Depends(get_preflight)]
IntegrityDep = Annotated[DatasetIntegrity, Depends(get_integrity)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
ViewsDep = Annotated[DatasetViews, Depends(get_views)]


def existing_row(dataset_id: str, views: ViewsDep) -> dict[str, Any]:
    """The dataset's job row; its 404 comes before a response (an event stream) starts."""
    return views.row(dataset_id)


ExistingRow = Annotated[dict, Depends(existing_row)]
