"""Request limits and error shapes, in-process (no engine: valid bodies get 503 while loading):
the OpenAPI schema and the validator agree, per-request lists are bounded, error codes are strings
or null, the Bearer scheme is case-insensitive, and long prompts are refused by their characters
before tokenizing and tokenized without stalling the event loop (issue #17)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from dspark_server.config import ServerConfig
from dspark_server.models.tokenizer import Tokenizer
from dspark_server.server.app import create_app
from dspark_server.server.protocol import APIError
from dspark_server.server.tokenize import PromptTokenizer

MSG = [{"role": "user", "content": "x"}]


def _client(api_key: str | None = None) -> TestClient:
    return TestClient(create_app(None, ServerConfig(api_key=api_key), "m"), raise_server_exceptions=True)


COMPLETIONS: list[dict[str, Any]] = (
    [
        {"prompt": p}
        for p in (
            "x",
            "",
            [],
            [[]],
            [1],
            [-1],
            [2**31],
            ["a"],
            [""],
            ["a", "b"],
            [[1]],
            [[1], [2]],
            [[-1]],
            5,
        )
    ]
    + [
        {"prompt": "x", "stop": s}
        for s in ([""], "", "a", ["a"] * 4, ["a"] * 5, ["a" * 256], ["a" * 257], "a" * 257, [], None)
    ]
    + [{"prompt": "x", "stop_token_ids": ids} for ids in ([0] * 256, [0] * 257, [-1], [])]
)
CHATS: list[dict[str, Any]] = [
    {"messages": []},
    {"messages": MSG * 2048},
    {"messages": MSG * 2049},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 256}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]},
    {"messages": MSG, "stop": [""]},
    {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]},
]


@pytest.mark.parametrize(
    "path,body",
    [("/v1/completions", b) for b in COMPLETIONS] + [("/v1/chat/completions", b) for b in CHATS],
    ids=[f"c{i}" for i in range(len(COMPLETIONS))] + [f"chat{i}" for i in range(len(CHATS))],
)
def test_the_schema_and_the_validator_agree(path: str, body: dict[str, Any]) -> None:
    client = _client()
    schema = client.get("/openapi.json").json()
    name = "CompletionRequest" if path == "/v1/completions" else "ChatCompletionRequest"
    root = {"$ref": f"#/components/schemas/{name}", "components": schema["components"]}
    allowed = jsonschema.Draft202012Validator(root).is_valid(body)
    r = client.post(path, json=body)
    assert r.status_code in (400, 503), r.text
    assert allowed == (r.status_code == 503), (body, r.json())
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["param"].split(".")[0] in ("prompt", "stop", "stop_token_ids", "messages"), err


def test_stop_and_list_bounds_name_the_rule() -> None:
    client = _client()
    r = client.post("/v1/completions", json={"prompt": "x", "stop": ["a" * 1000] * 4000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert "at most 4" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": [[]]})
    assert r.status_code == 400 and "non-empty" in r.json()["error"]["message"]


def test_error_codes_are_strings_or_null() -> None:
    client = _client(api_key="k")
    auth = {"Authorization": "Bearer k"}
    responses = [
        client.post("/v1/completions", json={"prompt": "x"}),  # 401
        client.post("/v1/completions", json={"prompt": "x", "temperature": 9}, headers=auth),  # 400
        client.post("/v1/completions", content=b"{nope", headers=auth),  # 400
        client.post("/v1/completions", json={"prompt": "x", "model": "other"}, headers=auth),  # 404
        client.get("/nope"),  # 404
        client.put("/v1/completions", headers=auth),  # 405
        client.post("/v1/completions", json={"prompt": "x"}, headers=auth),  # 503
    ]
    assert [r.status_code for r in responses] == [401, 400, 400, 404, 404, 405, 503]
    for r in responses:
        code = r.json()["error"]["code"]
        assert code is None or isinstance(code, str), r.json()
    schema = client.get("/openapi.json").json()["components"]["schemas"]["ErrorDetail"]
    assert {t.get("type") for t in schema["properties"]["code"]["anyOf"]} == {"string", "null"}


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(scheme: str) -> None:
    client = _client(api_key="k")
    r = client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": f"{scheme} k"})
    assert r.status_code == 503, r.text  # past auth: the model is still loading
    for wrong in (f"{scheme} K", f"{scheme}k", "Basic k", "k"):
        r = client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": wrong})
        assert r.status_code == 401, wrong


def _backend(tokenizer: Any, max_model_len: int = 256) -> Any:
    return SimpleNamespace(tokenizer=tokenizer, max_model_len=max_model_len)


def test_prompt_characters_are_refused_before_tokenizing() -> None:
    never = SimpleNamespace(max_token_chars=8, encode=lambda text: pytest.fail("tokenized"))
    pt = PromptTokenizer(ServerConfig(max_prompt_chars=1000))
    pt.check_chars(_backend(never), 1000, "prompt")  # at the limit: fine
    with pytest.raises(APIError) as info:
        pt.check_chars(_backend(never), 1001, "prompt")
    assert info.value.status == 413 and info.value.code == "prompt_too_large"
    pt = PromptTokenizer(ServerConfig())  # no configured limit: the model's own bound
    pt.check_chars(_backend(never), 256 * 8, "messages")
    with pytest.raises(APIError) as info:
        pt.check_chars(_backend(never), 256 * 8 + 1, "messages")
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert info.value.param == "messages" and "256" in info.value.message


def test_a_long_prompt_is_tokenized_without_stalling_the_loop_or_the_engine_thread(tiny_model: Path) -> None:
    tok = Tokenizer(tiny_model)
    text = "x y " * 500_000  # ~1.5 s of tokenizer time, all of it holding the GIL on the single-string path
    pt = PromptTokenizer(ServerConfig())
    thread_gaps: list[float] = []  # a thread standing in for the engine thread
    stop = threading.Event()

    def engine_like() -> None:
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            thread_gaps.append(now - last)
            last = now

    async def run() -> tuple[int, float, float]:
        lags: list[float] = []
        done = False

        async def tick() -> None:
            while not done:
                t0 = time.monotonic()
                await asyncio.sleep(0.005)
                lags.append(time.monotonic() - t0)

        ticker = asyncio.ensure_future(tick())
        t0 = time.monotonic()
        ids = await pt.run(lambda: tok.encode(text), len(text), "cannot tokenize", "prompt")
        took = time.monotonic() - t0
        done = True
        await ticker
        return len(ids), max(lags), took

    engine = threading.Thread(target=engine_like)
    engine.start()
    try:
        n, worst_loop, took = asyncio.run(run())
    finally:
        stop.set()
        engine.join()
        pt.shutdown()
    assert n == 1_000_001
    # before: a thread (the engine's) stood still for the whole tokenization (worst ~ took)
    bound = max(0.2, 0.4 * took)
    assert worst_loop < bound, f"the event loop stalled {worst_loop:.2f} s of {took:.2f} s"
    assert max(thread_gaps) < bound, f"the engine thread stalled {max(thread_gaps):.2f} s of {took:.2f} s"


def test_long_prompt_jobs_beyond_the_queue_limit_get_429() -> None:
    pt = PromptTokenizer(ServerConfig(max_tokenize_queue=1, tokenizer_workers=1))

    async def run() -> list[Any]:
        slow = asyncio.ensure_future(pt.run(lambda: time.sleep(0.3) or [1], 10_000, "x", "prompt"))
        await asyncio.sleep(0.05)
        second = pt.run(lambda: [2], 10_000, "x", "prompt")
        short = pt.run(lambda: [3], 10, "x", "prompt")  # short texts never wait for a worker
        return await asyncio.gather(slow, second, short, return_exceptions=True)

    first, second, short = asyncio.run(run())
    pt.shutdown()
    assert first == [1] and short == [3]
    assert isinstance(second, APIError) and second.status == 429 and second.code == "tokenizer_busy"
    assert second.headers["Retry-After"] == "1"
