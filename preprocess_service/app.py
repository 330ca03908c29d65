"""The FastAPI app: assembled here from the routers (:mod:`preprocess_service.routes`), the error handlers
(:mod:`~preprocess_service.handlers`), the lifespan that starts the service's parts
(:mod:`~preprocess_service.lifespan`) and the middlewares (auth, limits, request latency). The work is in
submit.py, jobs.py and worker.py."""

from __future__ import annotations

import os

from fastapi import FastAPI

from pf_trl._version import __version__
from preprocess_service.handlers import install_error_handlers
from preprocess_service.jobs import SECRET_ENV
from preprocess_service.lifespan import lifespan
from preprocess_service.metrics import RequestLatencyMiddleware, ServiceMetrics
from preprocess_service.routes import ROUTERS
from preprocess_service.schemas import PROBLEM_RESPONSES
from preprocess_service.security import BearerAuthMiddleware, BodyLimitMiddleware, RateLimitMiddleware
from preprocess_service.settings import Settings
from preprocess_service.store import setup_event_log


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service's app for ``settings`` (default: flags-free :meth:`Settings.load`, i.e. the environment)."""
    settings = settings or Settings.load()
    os.environ.update(settings.child_env())  # before datasets/transformers are imported in this process
    for name in SECRET_ENV:  # read into settings already: no child process (tokenizer pools...) inherits them
        os.environ.pop(name, None)
    setup_event_log(settings.log_level)
    app = FastAPI(
        title="pf-trl preprocessing service",
        version=__version__,
        description="Tokenize a dataset once into a shared cache of shards (with per-example lengths for the "
        "token-budget sampler); training jobs wait for it and read it. Errors are application/problem+json.",
        lifespan=lifespan,
        responses={k: PROBLEM_RESPONSES[k] for k in (400, 401, 422, 429, 503, 507)},
    )
    app.state.settings = settings
    app.state.metrics = ServiceMetrics(app.state)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    # The last added middleware is the outermost: auth runs before the body limit, so an unauthenticated client
    # cannot make the service buffer a body; the rate limit before auth (guessing counts too); the latency
    # histogram outermost, so that refusals count.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       max_upload_bytes=settings.max_upload_bytes)
    app.add_middleware(BearerAuthMiddleware, token=settings.token)
    app.add_middleware(RateLimitMiddleware, per_minute=settings.rate_limit_per_minute)
    app.add_middleware(RequestLatencyMiddleware, metrics=app.state.metrics)
    return app
