"""The C++ paged-attention kernel (kernels/paged_attention.cpp): built once, cached, called via ctypes.

The kernel is plain C++ with no torch headers, so it compiles in about a second
(``g++ -O3 -march=native -fopenmp``). The shared object is cached under
``$DSPARK_KERNEL_CACHE`` (default ``~/.cache/dspark_server/kernels``), keyed by the source, the
flags, the compiler and the CPU, and written atomically so concurrent processes can share it.
When no compiler is available (or the build fails) ``load_kernel()`` returns None: impl "auto"
then runs the gather path, "kernel" refuses to start. On CPUs without AVX-512 the same source
compiles to portable loops (tests/test_paged_attention.py builds that variant too).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from dspark_server.machine import cpu_flags
from dspark_server.models.paged_layout import PagedLayout

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "paged_attention.cpp"
# No -ffast-math: linking a shared object with it pulls in crtfastmath, which turns on flush-to-zero
# for the whole process when the kernel is loaded (Python then parses 5e-324 as 0.0). The flags
# below give the same vectorised reductions without touching the process's floating-point state.
FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-freciprocal-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
_P = ctypes.c_void_p
_I = ctypes.c_int64


def _cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_KERNEL_CACHE", Path.home() / ".cache" / "dspark_server" / "kernels"))


def build(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The cached shared object for this source, flags, compiler and CPU (compiled if missing)."""
    flags = (*FLAGS, *extra_flags)
    src = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), version.encode(), cpu_flags().encode()]))
    name = f"paged_attention_{key.hexdigest()[:16]}.so"
    out = _cache_dir() / name
    if out.is_file():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # e.g. a read-only home in a container
        out = Path(tempfile.gettempdir()) / "dspark_server_kernels" / name
        if out.is_file():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, check=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, failed build, or DSPARK_NO_KERNEL=1)."""
    if os.environ.get("DSPARK_NO_KERNEL") == "1":
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("no C++ compiler found: attention impl 'auto' uses the gather path")
        return None
    try:
        return open_kernel(build(compiler))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("paged attention kernel unavailable (%s): impl 'auto' uses the gather path", detail)
        return None


def open_kernel(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.dspark_paged_attention
    fn.restype = ctypes.c_int
    # dtype; q, kc, vc, slots; kmax; q_start, q_len, kv_limit, kx, vx; nseq, hq, hkv, d; scale; out, lse;
    # threads
    fn.argtypes = [ctypes.c_int, *[_P] * 4, _I, *[_P] * 5, *[_I] * 4, ctypes.c_float, _P, _P, ctypes.c_int]
    return lib


def kernel_supports(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the kernel handles these dtypes and head size (else use the PyTorch path)."""
    return (
        q.dtype in _DTYPES
        and cache.dtype == q.dtype
        and q.shape[-1] in _HEAD_DIMS
        and q.shape[1] % cache.shape[1] == 0
        and q.device.type == "cpu"
    )


def kernel_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: PagedLayout,
    want_lse: bool = False,
    extra: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, Hq, D], caches [S, Hkv, D] -> out [T, Hq, D] (and log-sum-exp [T, Hq] float32).

    ``extra`` = (k, v) [T, Hkv, D]: every query of sequence r also sees the rows of its own query
    rows in k / v, unmasked (the drafter's block attending to itself bidirectionally)."""
    if not kernel_supports(q, k_cache):
        raise ValueError(f"kernel does not support q {q.dtype} {tuple(q.shape)}, cache {k_cache.dtype}")
    q = q.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    kx = vx = None
    if extra is not None:
        kx, vx = (x.to(q.dtype).contiguous() for x in extra)
        if kx.shape != (q.shape[0], *k_cache.shape[1:]) or vx.shape != kx.shape:
            raise ValueError(f"extra keys must be [T, Hkv, D], got {tuple(kx.shape)}")
    t, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(t, hq, dtype=torch.float32) if want_lse else None
    rc = lib.dspark_paged_attention(
        _DTYPES[q.dtype],
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        layout.slots.data_ptr(),
        layout.slots.shape[1],
        layout.q_start.data_ptr(),
        layout.q_len.data_ptr(),
        layout.kv_limit.data_ptr(),
        kx.data_ptr() if kx is not None else None,
        vx.data_ptr() if vx is not None else None,
        layout.num_seqs,
        hq,
        k_cache.shape[1],
        d,
        d**-0.5,
        out.data_ptr(),
        lse.data_ptr() if lse is not None else None,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"paged attention kernel failed with code {rc}")
    return out, lse
