"""What one serving sweep runs: prompt files, concurrencies, modes, rounds, request shape."""

from __future__ import annotations

from dataclasses import dataclass

# Closed loop: at least this many requests per concurrency slot, so that the ramp-down at the end
# of a run (fewer requests left than slots) is not most of it.
REQUESTS_PER_SLOT = 2


@dataclass(frozen=True)
class ServingConfig:
    prompt_files: tuple[str, ...]
    concurrency: tuple[int, ...]
    out: str
    modes: tuple[str, ...] = ("off", "fixed", "threshold", "dspark")
    urls: tuple[str, ...] = ()  # empty: --self-host
    limit: int | None = None
    num_requests: int | None = None  # per run; default max(prompts, 2 x concurrency), prompts cycled
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    request_rate: float | None = None  # Poisson arrivals (req/s); concurrency still caps in flight
    rounds: int = 1
    seed: int = 0
    warmup_requests: int = 2
    server_args: tuple[str, ...] = ()  # flags for `dspark serve` (self-host)
    server_policy: str = "auto"  # auto | all | restart
    api_key: str | None = None
    request_timeout_s: float = 900.0
    progress: bool = True
    plots: bool = True
    command: str = ""
