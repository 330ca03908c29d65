"""The service's client without its extra, and the request-latency metrics, without starting the service."""

from __future__ import annotations

import sys
import time

import pytest


def test_client_without_its_extra_says_which_to_install(monkeypatch):
    from pf_trl.data import service_client

    monkeypatch.setitem(sys.modules, "httpx_sse", None)  # `import httpx_sse` raises ImportError
    started = time.monotonic()
    for call in (lambda: service_client.wait_for_dataset("http://127.0.0.1:9", "x", progress=False),
                 lambda: service_client.submit_dataset("http://127.0.0.1:9", {}),
                 lambda: service_client.get_dataset("http://127.0.0.1:9", "x")):
        with pytest.raises(service_client.ClientExtraMissing, match=r"pip install 'pf-trl\[service\]'") as info:
            call()
        assert isinstance(info.value, service_client.DatasetServiceError)
    assert time.monotonic() - started < 5, "said at once, not retried as an unreachable service"


def test_request_latency_is_labelled_by_route_template():
    pytest.importorskip("prometheus_client")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from preprocess_service.metrics import RequestLatencyMiddleware, ServiceMetrics

    app = FastAPI()
    app.state.metrics = ServiceMetrics(app.state)  # no store yet: the job-store families are left out

    @app.get("/v1/items/{item_id}")
    def item(item_id: str) -> dict:
        return {"id": item_id}

    app.add_middleware(RequestLatencyMiddleware, metrics=app.state.metrics)
    client = TestClient(app)
    assert client.get("/v1/items/abc").status_code == 200
    assert client.get("/v1/items/def").status_code == 200
    assert client.get("/made/up/path").status_code == 404
    text = app.state.metrics.render().decode()
    count = 'pf_service_http_request_duration_seconds_count{method="GET",route="/v1/items/{item_id}",status="200"} '
    assert count + "2.0" in text, text
    assert 'route="unmatched",status="404"' in text
    assert "abc" not in text and "/made/up/path" not in text, "raw paths never become labels"
    assert "pf_service_jobs" not in text
