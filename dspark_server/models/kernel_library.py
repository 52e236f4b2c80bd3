"""The C++ kernels (kernels/*.cpp): one shared library, built once, cached, called via ctypes.

The library holds the paged attention (paged_kernel.py calls it) and the decoder layer's fused
element-wise steps (layer_ops.py). It is plain C++ with no torch headers, so it compiles in a few
seconds (``g++ -O3 -march=native -fopenmp``). The shared object is cached under
``$DSPARK_KERNEL_CACHE`` (default ``~/.cache/dspark_server/kernels``), keyed by the source, the
flags, the compiler and the CPU, and written atomically so concurrent processes can share it.
When no compiler is available (or the build fails) ``load_library()`` returns None: attention impl
"auto" then runs the gather path, "kernel" refuses to start, and the layers run their PyTorch
path. On CPUs without AVX-512 the attention compiles to an AVX2 + FMA path, and without AVX2 to
portable loops (tests/test_paged_attention.py builds both variants too); the float32 GEMM of a
few rows (linear_f32.cpp) needs AVX2 + FMA, else the BLAS sgemm serves.
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

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "kernels"
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
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' dtype codes
MIXED_BF16_CACHE = 2  # float32 activations over a bfloat16 KV cache (attention, the K/V store)


def cache_dtype_code(activations: torch.dtype, cache: torch.dtype) -> int | None:
    """The code of the kernels that read or write a ``cache`` KV pool under ``activations``:
    one dtype for both, or float32 over bfloat16; None where no kernel does."""
    if activations == cache:
        return DTYPES.get(activations)
    return MIXED_BF16_CACHE if (activations, cache) == (torch.float32, torch.bfloat16) else None


_P = ctypes.c_void_p
_I = ctypes.c_int64


def _cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_KERNEL_CACHE", Path.home() / ".cache" / "dspark_server" / "kernels"))


def _source_bytes() -> bytes:
    return b"\0".join(p.read_bytes() for p in sorted(KERNEL_DIR.glob("*.[ch]*")))


def source_digest() -> str:
    """A short hash of the kernels' source: measured step costs are only valid for the same kernels."""
    return hashlib.sha256(_source_bytes()).hexdigest()[:16]


def build(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The cached shared object for this source, flags, compiler and CPU (compiled if missing)."""
    flags = (*FLAGS, *extra_flags)
    sources = sorted(KERNEL_DIR.glob("*.cpp"))
    src = _source_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), version.encode(), cpu_flags().encode()]))
    name = f"dspark_kernels_{key.hexdigest()[:16]}.so"
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
        cmd = [compiler, *flags, *map(str, sources), "-o", tmp]
        subprocess.run(cmd, capture_output=True, text=True, check=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (no compiler, failed build, or DSPARK_NO_KERNEL=1)."""
    if os.environ.get("DSPARK_NO_KERNEL") == "1":
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("no C++ compiler found: the PyTorch paths run (attention impl 'auto': gather)")
        return None
    try:
        return open_library(build(compiler))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("C++ kernels unavailable (%s): the PyTorch paths run (attention 'auto': gather)", detail)
        return None


@functools.cache
def blas_sgemm() -> int | None:
    """The address of the Fortran ``sgemm_`` PyTorch's float32 linear layers run (MKL on x86), or None."""
    return torch_blas_symbol("sgemm_")


def torch_blas_symbol(name: str) -> int | None:
    """The address of the Fortran BLAS routine ``name`` in PyTorch's own libtorch_cpu, or None."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for lib_name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = lib_dir / lib_name
        if path.is_file():
            try:
                fn = getattr(ctypes.CDLL(str(path)), name)
            except (OSError, AttributeError):
                return None
            return ctypes.cast(fn, ctypes.c_void_p).value
    return None


_C, _F = ctypes.c_int, ctypes.c_float
SIGNATURES = {  # every function returns an int status (0: done)
    # dtype; q, kc, vc, slots; kmax; q_start, q_len, kv_limit, kx, vx; nseq, hq, hkv, d; scale; out, lse;
    # threads
    "dspark_paged_attention": [_C, *[_P] * 4, _I, *[_P] * 5, *[_I] * 4, _F, _P, _P, _C],
    # dtype; x, delta, sum_out, weight, out; rows, dim; eps; threads
    "dspark_rms_norm": [_C, *[_P] * 5, _I, _I, _F, _C],
    # dtype; qkv; tokens, hq, hkv, d; positions, inv_freq, qk_weight; eps; slots, k_cache, v_cache,
    # q_out; threads
    "dspark_qk_norm_rope_store": [_C, _P, *[_I] * 4, *[_P] * 3, _F, *[_P] * 4, _C],
    # dtype; gate_up, out; rows, inter; threads
    "dspark_silu_mul": [_C, _P, _P, _I, _I, _C],
    # sgemm; tokens, ids, positions, slot_mapping, kv_slots; kmax, q_start, q_len, kv_limit; nseq;
    # embed; hidden, layers, hq, hkv, d, inter; eps, qk_eps; inv_freq, weights, caches, final_norm,
    # lm_wt, lm_packed; vocab; rows; nrows; logits; capture; ncap; hidden_out; block_mode; normed_out;
    # threads; weight_bf16; kv_bf16
    "dspark_decoder_forward_f32": [_P, _I, *[_P] * 4, _I, *[_P] * 3, _I, _P, *[_I] * 6, _F, _F]
    + [*[_P] * 6, _I, _P, _I, _P, _P, _I, _P, _C, _P, _C, _C, _C],
    # sgemm; weight_bf16; tokens; features; cdim; fc, fc_packed, hidden_norm; hidden; eps;
    # layers, hkv, d; k_eps; inv_freq, layer_table, positions, slots, caches; threads; kv_bf16
    # (the second argument: gemm.h's WeightFormat)
    "dspark_context_write_f32": [_P, _C, _I, _P, _I, *[_P] * 3, _I, _F, *[_I] * 3, _F, *[_P] * 5, _C, _C],
    # sgemm; rows, g, vocab, rank; base, anchors, w1, w2t, w2t packed (or null), tokens; threads
    "dspark_markov_greedy_f32": [_P, *[_I] * 4, *[_P] * 6, _C],
    # rows, g, vocab, rank; base, anchors, w1, w2 (bf16), tokens; threads
    "dspark_markov_greedy_bf16w": [*[_I] * 4, *[_P] * 5, _C],
    # sgemm; rows, g, vocab, rank; base, anchors, w1, w2t, w2t packed (or null), temperatures,
    # uniforms (float64), keyed (uint8), keys (uint64), tokens, probs; threads
    "dspark_markov_sample_f32": [_P, *[_I] * 4, *[_P] * 11, _C],
    # x; m, k; packed bf16 weight; n; out; accumulate; threads
    "dspark_linear_bf16": [_P, _I, _I, _P, _I, _P, _C, _C],
    # the same; variant: 0 dot (VDPBF16PS), 1 fma (float32 FMAs), 2 amx (the tile unit)
    "dspark_linear_bf16_variant": [_P, _I, _I, _P, _I, _P, _C, _C, _C],
    "dspark_bf16_gemm_variant": [],
    "dspark_has_bf16": [],
    "dspark_has_amx": [],
    # x; m, k; int8 weight buffer (int8_weights.py); n; out; accumulate; threads
    "dspark_linear_int8": [_P, _I, _I, _P, _I, _P, _C, _C],
    "dspark_has_int8": [],
    # x; m, k; packed float32 weight (f32_weights.py); n; out; accumulate; threads
    "dspark_linear_f32": [_P, _I, _I, _P, _I, _P, _C, _C],
    "dspark_has_linear_f32": [],
    # logits; rows, vocab; temperatures, uniforms (float64), keyed (uint8), keys (uint64), out; threads
    "dspark_sample_temperature": [_P, _I, _I, *[_P] * 5, _C],
    # weights; rows, vocab; keys (uint64), out; threads
    "dspark_keyed_argmax": [_P, _I, _I, _P, _P, _C],
}


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return lib
