"""`dspark serve` as a real process on a loopback port, driven by the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_api_support import LoggedServer


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LoggedServer]:
    proc = LoggedServer(["--model", str(tiny_model), "--max-model-len", "256"])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_chat_and_completions_stream_and_not(server: LoggedServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "def add"}], max_tokens=12, temperature=0
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 12
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 12
    text = chat.choices[0].message.content

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "def add"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == text
    assert reasons[-1] == "length"
    assert usage is not None and usage.completion_tokens == 12

    comp = client.completions.create(model=model, prompt="class Point:", max_tokens=8, temperature=0)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 8
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="class Point:", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == comp.choices[0].text


def test_seeded_sampling_is_reproducible_over_http(server: LoggedServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    kw = dict(model=client.models.list().data[0].id, prompt=[5, 6, 7], max_tokens=16, temperature=1.0)
    a = client.completions.create(seed=42, **kw).choices[0].text
    assert a == client.completions.create(seed=42, **kw).choices[0].text
    assert a != client.completions.create(seed=43, **kw).choices[0].text


def test_bad_input_is_a_400_with_openai_error_body(server: LoggedServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1000
        )
    assert "256" in exc.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], temperature=3.0
        )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
