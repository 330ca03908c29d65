"""pf-trl preprocessing service: tokenize once into a shared cache, let many training jobs read it.

Modules: ``settings`` (flags + ``PF_SERVICE_*`` env), ``schemas`` (pydantic models, problem+json),
``security`` (bearer token, path confinement, body limits), ``store`` (the job store: SQLite or
PostgreSQL behind one interface), ``jobs`` (worker supervision), ``worker`` (the worker process: calls
:func:`pf_trl.data.pretokenize.pretokenize`), ``app`` (the FastAPI app factory and routes). See
docs/service.md.

This package imports nothing heavy at import time: worker processes import only what they need.
"""

API_VERSION = "v1"
