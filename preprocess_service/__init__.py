"""pf-trl preprocessing service: tokenize once into a shared cache, let many training jobs read it.

Modules: ``serve`` (``pf-trl serve``: flags, main), ``settings`` (flags + ``PF_SERVICE_*`` env), ``schemas``
(pydantic models, problem+json), ``security`` (bearer token, path confinement, body limits), ``store`` (the job
store: SQLite or PostgreSQL behind one interface), ``app`` (assembles the FastAPI app), ``routes`` (one router per
resource), ``deps`` (what routes take, by ``Depends``), ``views`` (job rows as API answers), ``handlers``
(problem+json errors), ``lifespan`` (start/stop), ``metrics`` (``/metrics``), ``submit`` / ``mixtures`` (POST's
checks), ``jobs`` (worker supervision), ``worker`` / ``build`` (the worker process: calls
:func:`pf_trl.data.pretokenize.pretokenize`). See docs/service.md.

This package imports nothing heavy at import time: worker processes import only what they need.
"""

API_VERSION = "v1"
