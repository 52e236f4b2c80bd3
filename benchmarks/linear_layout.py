"""F.linear with the weight row-major (as loaded) vs column-major (``layers.serving_layout``).

For the demo target's and the K = 8 twin's matrix shapes and row counts M = 1 (a decode), 8 (a
verification block), 64 and 256 (batches and prefill chunks), in float32 and bfloat16: the median
time of each layout, interleaved repetition by repetition, and their ratio. The serving path
stores float32 weights column-major because MKL reads them faster at the small M of speculative
verification, and keeps bfloat16 weights row-major, which oneDNN reads faster. Trust the ratios,
not the absolute times, on a shared machine.

    python benchmarks/linear_layout.py --threads 2 --out runs/linear_layout.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # (in, out): what the matrix is
    (256, 512): "demo q|k|v",
    (256, 1152): "demo gate|up",
    (576, 256): "demo down",
    (256, 6144): "demo LM head",
    (2048, 4096): "twin q|k|v",
    (2048, 9216): "twin gate|up",
    (2048, 6144): "twin LM head",
}


def _call_us(x: torch.Tensor, w: torch.Tensor, calls: int) -> float:
    """Mean microseconds of one F.linear over ``calls`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        F.linear(x, w)
    return 1e6 * (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--out", default="runs/linear_layout.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for (k, n), what in SHAPES.items():
            row_major = torch.randn(n, k, generator=g).to(dtype)
            col_major = row_major.t().contiguous().t()
            for m in args.rows:
                x = torch.randn(m, k, generator=g).to(dtype)
                inner = max(1, 2000 // (m * max(1, n * k // 200_000)))  # ~ms per timed call
                times: dict[str, list[float]] = {"row_major": [], "column_major": []}
                for _ in range(args.reps):
                    for name, w in (("row_major", row_major), ("column_major", col_major)):
                        F.linear(x, w)  # warm
                        times[name].append(_call_us(x, w, inner))
                row = {
                    "dtype": str(dtype).removeprefix("torch."),
                    "matrix": what,
                    "in": k,
                    "out": n,
                    "rows": m,
                    "row_major_us": round(statistics.median(times["row_major"]), 2),
                    "column_major_us": round(statistics.median(times["column_major"]), 2),
                }
                row["speedup"] = round(row["row_major_us"] / row["column_major_us"], 3)
                results.append(row)
                print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
