"""The app's lifecycle states in-process (no engine): while the model loads, /health and /ready
are 503 (as SGLang's and llama.cpp's /health are) and /v1/* 503 with Retry-After; draining looks
the same to clients; metrics still scrape.
(The real-process drain, with requests in flight, is in test_api_overload.py.)"""

from __future__ import annotations

from fastapi.testclient import TestClient

from dspark_server.config import ServerConfig
from dspark_server.server.app import create_app


def _client(api_key: str | None = None) -> tuple[TestClient, object]:
    app = create_app(None, ServerConfig(api_key=api_key), "m")
    return TestClient(app, raise_server_exceptions=True), app.state.dspark


def test_loading_then_draining_answer_503() -> None:
    client, state = _client()
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_loading"
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_loading"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert "loading" in r.json()["error"]["message"]
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] is None
    metrics = client.get("/metrics").text
    assert "dspark_server_ready 0.0" in metrics and "dspark_kv_cache_free_pages" not in metrics
    state.draining = True  # type: ignore[attr-defined]
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_draining"
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert "dspark_server_draining 1.0" in client.get("/metrics").text


def test_validation_and_auth_come_first_even_while_loading() -> None:
    client, _ = _client(api_key="k")
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    headers = {"Authorization": "Bearer k"}
    r = client.post("/v1/completions", json={"prompt": "x", "temperature": 9}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = client.post("/v1/completions", json={"prompt": "x", "model": "other"}, headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.get("/nope")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = client.put("/v1/completions", headers=headers)
    assert r.status_code == 405 and "error" in r.json()
