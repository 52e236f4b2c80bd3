"""Probe a running `dspark serve` with large request bodies (issue #17, item 1).

    python -m tools.big_body_probe --url http://127.0.0.1:8000 --pid PID [--bodies 8 --mb 4]

While ``--bodies`` chat bodies of ``--mb`` MB each (``"x y "`` repeated) arrive in parallel, one
streaming request runs and ``/health`` is polled every 20 ms. Reports the worst ``/health``
latency and the stream's worst gap between chunks during the burst, how long the bodies took to
be answered (and with what), and the server's resident memory: before, peak (VmHWM) and after.
Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx


def _rss_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak(pid: int) -> None:
    with contextlib.suppress(OSError):  # writing 5 resets VmHWM to the current RSS (Linux >= 4.0)
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--pid", type=int, required=True, help="the server's process id (for its memory)")
    ap.add_argument("--bodies", type=int, default=8)
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--stream-tokens", type=int, default=1900)
    args = ap.parse_args()
    reps = int(args.mb * 1e6 / 4)
    body = json.dumps({"messages": [{"role": "user", "content": "x y " * reps}], "max_tokens": 4}).encode()
    stop = threading.Event()
    gaps: list[tuple[float, float]] = []  # (time, gap)
    health: list[tuple[float, float]] = []

    def stream() -> None:
        req = {
            "messages": [{"role": "user", "content": "def add"}],
            "max_tokens": args.stream_tokens,
            "temperature": 0,
            "ignore_eos": True,  # the stream must outlast the burst
            "stream": True,
        }
        with httpx.stream("POST", f"{args.url}/v1/chat/completions", json=req, timeout=300) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                now = time.monotonic()
                if line.startswith("data: "):
                    gaps.append((now, now - last))
                    last = now
                if stop.is_set():
                    return

    def poll_health() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                c.get(f"{args.url}/health")
                health.append((t0, time.monotonic() - t0))
                time.sleep(0.02)

    results: list[tuple[int, float, str]] = []
    body_file = Path(tempfile.mkstemp(suffix=".json")[1])
    body_file.write_bytes(body)

    def send_big() -> None:  # curl in its own process: the sender does not compete for our GIL
        t0 = time.monotonic()
        cmd = ["curl", "-s", "-m", "300", "-H", "content-type: application/json"]
        cmd += ["--data-binary", f"@{body_file}", "-w", "\n%{http_code}", f"{args.url}/v1/chat/completions"]
        out = subprocess.run(cmd, capture_output=True, text=True).stdout
        text, _, status = out.rpartition("\n")
        try:
            code = json.loads(text).get("error", {}).get("code", "ok")
        except ValueError:
            code = text[:40]
        results.append((int(status or 0), time.monotonic() - t0, str(code)))

    streamer = threading.Thread(target=stream, daemon=True)
    poller = threading.Thread(target=poll_health, daemon=True)
    streamer.start()
    poller.start()
    time.sleep(2.0)  # the stream is under way; baseline gaps
    base_gap = max((g for _, g in gaps[1:]), default=0.0)
    base_health = max((h for _, h in health), default=0.0)
    _reset_peak(args.pid)
    rss0 = _rss_kb(args.pid, "VmRSS")
    t_start = time.monotonic()
    senders = [threading.Thread(target=send_big) for _ in range(args.bodies)]
    for s in senders:
        s.start()
    for s in senders:
        s.join(300)
    t_end = time.monotonic()
    body_file.unlink()
    time.sleep(1.0)
    stop.set()
    peak = _rss_kb(args.pid, "VmHWM")
    rss1 = _rss_kb(args.pid, "VmRSS")
    window = [g for t, g in gaps if t_start <= t <= t_end + 0.5]
    hwindow = [h for t, h in health if t_start <= t <= t_end]
    report = {
        "bodies": args.bodies,
        "body_bytes": len(body),
        "burst_s": round(t_end - t_start, 3),
        "answers": sorted({f"{s} {c}" for s, _, c in results}),
        "slowest_answer_s": round(max(t for _, t, _ in results), 3),
        "baseline_health_max_ms": round(base_health * 1000, 1),
        "health_max_ms": round(max(hwindow, default=0.0) * 1000, 1),
        "health_probes": len(hwindow),
        "baseline_stream_gap_max_ms": round(base_gap * 1000, 1),
        "stream_gap_max_ms": round(max(window, default=0.0) * 1000, 1),
        "stream_chunks_in_burst": len(window),
        "rss_before_mb": round(rss0 / 1024, 1),
        "rss_peak_mb": round(peak / 1024, 1),
        "rss_after_mb": round(rss1 / 1024, 1),
        "peak_growth_mb": round((peak - rss0) / 1024, 1),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
