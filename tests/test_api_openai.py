"""The OpenAI-compatible API on a real `dspark serve` process, driven by the official `openai`
client: round trips, usage, seeds, stops, every client error as the right exception and status,
auth, body limits, an abort storm, and schemathesis against the server's own /openapi.json."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_api_support import LoggedServer, family_total, scrape, start, value, wait_idle

API_KEY = "test-key-123"
MAX_MODEL_LEN = 64
MAX_BODY = 16384
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LoggedServer]:
    # The key comes from the environment variable (the flag is covered by the same code path).
    s = start(
        [
            "--model",
            str(tiny_model),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-body-bytes",
            str(MAX_BODY),
            "--served-model-name",
            "tiny",
        ],
        env={"DSPARK_API_KEY": API_KEY},
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LoggedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


def _chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("model", "tiny")
    kw.setdefault("messages", [{"role": "user", "content": "def add"}])
    return client.chat.completions.create(**kw)


def _collect_stream(stream: Any, chat: bool) -> tuple[str, list[str | None], Any]:
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append((choice.delta.content or "") if chat else choice.text)
            reasons.append(choice.finish_reason)
    return "".join(pieces), reasons, usage


def test_chat_and_completions_stream_and_not_with_usage(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = _chat(client, max_tokens=10, temperature=0, extra_body={"no_such_field": [1, 2], "logit_bias": {}})
    assert chat.object == "chat.completion" and chat.choices[0].finish_reason == "length"
    u = chat.usage
    assert u.completion_tokens == 10 and u.total_tokens == u.prompt_tokens + 10 and u.prompt_tokens > 0
    spec = u.model_extra["spec"]  # the usage extension is there (speculation off: no rounds)
    assert spec["rounds"] == 0 and spec["accepted_tokens"] == 0

    stream = _chat(client, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True})
    text, reasons, usage = _collect_stream(stream, chat=True)
    assert text == chat.choices[0].message.content
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert usage.completion_tokens == 10 and usage.prompt_tokens == u.prompt_tokens

    # max_completion_tokens is honoured (and wins over max_tokens)
    short = _chat(client, max_completion_tokens=3, max_tokens=9, temperature=0)
    assert short.usage.completion_tokens == 3

    comp = client.completions.create(model="tiny", prompt="class Point:", max_tokens=8, temperature=0)
    assert comp.object == "text_completion" and comp.choices[0].finish_reason == "length"
    assert comp.usage.completion_tokens == 8
    text, reasons, usage = _collect_stream(
        client.completions.create(
            model="tiny",
            prompt="class Point:",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ),
        chat=False,
    )
    assert text == comp.choices[0].text and reasons[-1] == "length" and usage.completion_tokens == 8
    # token-id prompts and a one-element batch are accepted
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 4
    one = client.completions.create(model="tiny", prompt=["class Point:"], max_tokens=8, temperature=0)
    assert one.choices[0].text == comp.choices[0].text


def test_a_repeated_prompt_reports_its_cached_tokens(client: openai.OpenAI) -> None:
    """The prefix cache keeps full pages (16 tokens) of a finished prompt: a prompt sharing them
    is served from them, with the same greedy text, and its usage says how many it reused."""
    shared = [(7 * i + 3) % 90 + 10 for i in range(36)]
    kw: dict[str, Any] = dict(model="tiny", max_tokens=8, temperature=0)
    first = client.completions.create(prompt=shared + [1, 2, 3], **kw)
    again = client.completions.create(prompt=shared + [1, 2, 3], **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32  # 2 full pages of the 38 looked up
    assert again.choices[0].text == first.choices[0].text
    stream = client.completions.create(
        prompt=shared[:33] + [4], stream=True, stream_options={"include_usage": True}, **kw
    )
    usage = [c.usage for c in stream if c.usage][0]
    assert usage.prompt_tokens == 34 and usage.prompt_tokens_details.cached_tokens == 32


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt=[5, 6, 7], max_tokens=16, temperature=1.0)
    a = client.completions.create(seed=42, **kw).choices[0].text
    assert a == client.completions.create(seed=42, **kw).choices[0].text
    streamed, _, _ = _collect_stream(client.completions.create(seed=42, stream=True, **kw), chat=False)
    assert streamed == a
    assert a != client.completions.create(seed=43, **kw).choices[0].text


def _stop_case(client: openai.OpenAI) -> tuple[str, str, str]:
    """A prompt, a two-character stop string whose first occurrence is inside the greedy output
    (not at its start), and the text before it."""
    for prompt in ("hello", "The quick brown fox", "class Point:", "def add", "Speculative"):
        text = (
            client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
            .choices[0]
            .text
        )
        for k in range(2, len(text) - 2):
            stop = text[k : k + 2]
            if "\ufffd" not in text[: k + 2] and text.find(stop) == k:
                return prompt, stop, text[:k]
    raise AssertionError("no usable stop string in the tiny model's outputs")


def test_stop_strings_cut_the_output_in_both_modes(client: openai.OpenAI) -> None:
    prompt, stop, expected = _stop_case(client)
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "never-appears"]
    )
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    text, reasons, _ = _collect_stream(
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True
        ),
        chat=False,
    )
    assert text == expected and reasons[-1] == "stop"


def _raw(
    server: LoggedServer,
    path: str,
    content: bytes | Any,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    hdrs = {"content-type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(f"{server.base_url}{path}", content=content, headers=hdrs, timeout=30)


def _assert_error_body(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


MSG = [{"role": "user", "content": "x"}]
CLIENT_ERRORS = [  # (id, call kwargs, exception, status, param, words the message must contain)
    ("temperature>2", dict(messages=MSG, temperature=2.5), openai.BadRequestError, 400, "temperature", []),
    ("temperature<0", dict(messages=MSG, temperature=-0.1), openai.BadRequestError, 400, "temperature", []),
    ("top_p=0", dict(messages=MSG, top_p=0), openai.BadRequestError, 400, "top_p", []),
    ("top_p>1", dict(messages=MSG, top_p=1.5), openai.BadRequestError, 400, "top_p", []),
    ("max_tokens=0", dict(messages=MSG, max_tokens=0), openai.BadRequestError, 400, "max_tokens", []),
    (
        "over-context",
        dict(messages=MSG, max_tokens=1000),
        openai.BadRequestError,
        400,
        "max_tokens",
        [str(MAX_MODEL_LEN), "1000"],
    ),
    ("empty-messages", dict(messages=[]), openai.BadRequestError, 400, "messages", []),
    (
        "unknown-role",
        dict(messages=[{"role": "wizard", "content": "x"}]),
        openai.BadRequestError,
        400,
        "messages.0.role",
        [],
    ),
    ("n=2", dict(messages=MSG, n=2), openai.BadRequestError, 400, "n", ["n=2"]),
    ("wrong-type", dict(messages=MSG, max_tokens="5"), openai.BadRequestError, 400, "max_tokens", []),
    ("wrong-type-bool", dict(messages=MSG, stream="yes"), openai.BadRequestError, 400, "stream", []),
    (
        "content-not-text",
        dict(messages=[{"role": "user", "content": 5}]),
        openai.BadRequestError,
        400,
        "messages.0.content",
        [],
    ),
    ("unknown-model", dict(messages=MSG, model="gpt-17"), openai.NotFoundError, 404, "model", ["gpt-17"]),
]


@pytest.mark.parametrize(
    "kwargs,exc,status,param,words", [c[1:] for c in CLIENT_ERRORS], ids=[c[0] for c in CLIENT_ERRORS]
)
def test_client_errors_surface_as_openai_exceptions(
    client: openai.OpenAI, kwargs: dict, exc: type, status: int, param: str, words: list[str]
) -> None:
    kwargs = {"model": "tiny", **kwargs}
    with pytest.raises(exc) as info:
        client.chat.completions.create(**kwargs)
    assert info.value.status_code == status
    err = _assert_error_body(info.value.response.json())
    assert err["param"] == param
    for w in words:
        assert w in err["message"]


def test_extreme_but_valid_values_are_served(server: LoggedServer, client: openai.OpenAI) -> None:
    # tiny temperature / top_p once overflowed the sampler into NaN probabilities (a 500)
    for extra in (
        dict(temperature=1e-30),
        dict(temperature=5e-324, top_p=5e-324),
        dict(temperature=1.0, top_p=1e-300, top_k=2**31 - 1),
        dict(temperature=2.0, seed=-(2**63)),
        dict(temperature=0.5, seed=2**63 - 1),
        dict(stop_token_ids=[0, 2**31 - 1], stop=["a", "b", "c", "d" * 256]),  # OpenAI's limit: 4
    ):
        # Sent as JSON text of our own: a client library may format a subnormal float as 0.0.
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "def add"}],
            "max_tokens": 3,
            **extra,
        }
        r = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            content=json.dumps(body),
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), extra
    # a null for any optional field means "default", as with OpenAI
    body = {
        "messages": MSG,
        "max_tokens": 2,
        "temperature": None,
        "top_p": None,
        "n": None,
        "stream": None,
        "stop": None,
        "seed": None,
        "user": None,
    }
    r = _raw(server, "/v1/chat/completions", json.dumps(body).encode())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_prompt_over_context_names_both_numbers(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=list(range(10, 70)), max_tokens=10)
    msg = info.value.response.json()["error"]["message"]
    assert str(MAX_MODEL_LEN) in msg and "70" in msg and "60 in the prompt" in msg


@pytest.mark.parametrize(
    "body,param",
    [
        (b"{not json", None),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', "top_p"),
        (b"[1, 2, 3]", None),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        (b"\xff\xfe garbage", None),
        (b"", None),
    ],
    ids=["malformed", "nan", "inf", "not-object", "lone-surrogate", "not-utf8", "empty"],
)
def test_bad_bodies_are_400_with_the_error_shape(
    server: LoggedServer, body: bytes, param: str | None
) -> None:
    r = _raw(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = _assert_error_body(r.json())
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_completions_prompt_errors(server: LoggedServer, client: openai.OpenAI) -> None:
    for prompt in ([5, 100000], [-1], "", [], ["a", "b"], [[1], [2]], "\ud800"):
        r = _raw(server, "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt}).encode())
        assert r.status_code == 400, (prompt, r.text)
        assert _assert_error_body(r.json())["param"] == "prompt"


def test_auth_is_required_on_v1_only(server: LoggedServer) -> None:
    wrong = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.status_code == 401
    _assert_error_body(info.value.response.json())
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="x", max_tokens=1)
    for headers in ({}, {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"}):
        r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        _assert_error_body(r.json())
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.base_url}/ready").json() == {"status": "ready"}
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


def test_body_over_the_limit_is_413_with_or_without_content_length(
    server: LoggedServer, client: openai.OpenAI
) -> None:
    big = "x " * MAX_BODY
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny", prompt=big, max_tokens=1)
    assert info.value.status_code == 413
    _assert_error_body(info.value.response.json())

    payload = json.dumps({"model": "tiny", "prompt": big, "max_tokens": 1}).encode()

    def chunked() -> Iterator[bytes]:  # a generator body: sent chunked, no Content-Length
        for i in range(0, len(payload), 4096):
            yield payload[i : i + 4096]

    r = httpx.post(
        f"{server.base_url}/v1/completions",
        content=chunked(),
        headers={"content-type": "application/json", **AUTH},
        timeout=30,
    )
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 413
    _assert_error_body(r.json())
    # just under the limit, chunked, is served
    ok = json.dumps({"model": "tiny", "prompt": "def add", "max_tokens": 2}).encode()
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        content=iter([ok[:5], ok[5:]]),
        headers={"content-type": "application/json", **AUTH},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_openapi_declares_errors_and_not_422(server: LoggedServer) -> None:
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/metrics"} <= set(
        schema["paths"]
    )
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "408", "413", "429", "503"} == set(responses)
        assert "text/event-stream" in responses["200"]["content"]
    for item in schema["paths"].values():
        for op in item.values():
            assert "422" not in op["responses"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_schemathesis_finds_no_server_error_and_no_schema_violation(
    server: LoggedServer, tmp_path: Path
) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    assert st, "schemathesis is not installed (pip install -e .[test])"
    # Bodies over --max-body-bytes are refused (413) before their fields are looked at.
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        '[checks.negative_data_rejection]\nexpected-statuses = ["400", "401", "404", "405", "413", "429"]\n'
    )
    cmd = [
        st,
        "--config-file",
        str(config),
        "run",
        f"{server.base_url}/openapi.json",
        "-H",
        f"Authorization: Bearer {API_KEY}",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--max-examples",
        "6",
        "--seed",
        "7",
        "--phases",
        "coverage,fuzzing",
        "--workers",
        "1",
        "--no-shrink",
        "--request-timeout",
        "20",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "No issues found" in out, out[-3000:]
    tested = scrape(server.base_url)
    assert value(tested, "dspark_requests_total", endpoint="/v1/chat/completions", status="500") == 0
    assert value(tested, "dspark_requests_total", endpoint="/v1/completions", status="500") == 0


async def _storm(base_url: str, n: int, max_tokens: int = 40) -> int:
    """n streaming chat clients that hang up after their first chunk; returns how many got one."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "def add"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    got = 0

    async def one(c: httpx.AsyncClient) -> None:
        nonlocal got
        async with c.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    got += 1
                    return  # leaving the block closes the connection mid-stream

    limits = httpx.Limits(max_connections=n + 5, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        await asyncio.gather(*(one(c) for _ in range(n)))
    return got


@pytest.fixture(scope="module")
def long_server(tiny_model: Path) -> Iterator[LoggedServer]:
    """Room for long generations: the engine, in a process of its own, runs ahead of the HTTP
    side, and a short one could finish before its client's disconnect reaches it."""
    s = start(
        ["--model", str(tiny_model), "--max-model-len", "1024", "--served-model-name", "tiny"],
        env={"DSPARK_API_KEY": API_KEY},
    )
    yield s
    s.stop()


def test_abort_storm_frees_every_kv_page(long_server: LoggedServer) -> None:
    server = long_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    before = wait_idle(server.base_url)
    free0 = value(before, "dspark_kv_cache_free_pages")
    assert free0 == value(before, "dspark_kv_cache_total_pages") > 0
    aborted0 = value(before, "dspark_request_success_total", finished_reason="abort")
    finished0 = family_total(before, "dspark_request_success_total")
    t0 = time.monotonic()
    assert asyncio.run(_storm(server.base_url, 50, max_tokens=900)) == 50
    after = wait_idle(server.base_url, timeout=20)
    assert time.monotonic() - t0 < 30
    assert family_total(after, "dspark_request_success_total") - finished0 == 50
    # the requests were aborted by the disconnects, not run to completion
    assert value(after, "dspark_request_success_total", finished_reason="abort") - aborted0 >= 40
    ok = _chat(client, max_tokens=5, temperature=0)
    assert ok.usage.completion_tokens == 5
    final = wait_idle(server.base_url)
    assert value(final, "dspark_kv_cache_free_pages") == free0
    assert value(final, "dspark_kv_cache_used_pages") == 0
