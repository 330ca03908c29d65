"""The API's routers, one per resource; :func:`preprocess_service.app.create_app` includes them in this order."""

from preprocess_service.routes import datasets, events, health, mixtures, uploads

ROUTERS = (datasets.router, mixtures.router, uploads.router, events.router, health.router)
