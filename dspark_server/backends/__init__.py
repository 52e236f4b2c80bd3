"""Engines other than the native one, behind the same ``Backend`` interface.

``sglang``: SGLang 0.5.23's engine with DSpark (GPU only); ``sglang_args``: the pure mappings of our
settings, sampling parameters and statistics to and from SGLang's (importable anywhere).
Names are resolved lazily so ``import dspark_server.backends`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SGLangConfig": "dspark_server.backends.sglang_args",
    "build_server_kwargs": "dspark_server.backends.sglang_args",
    "build_env": "dspark_server.backends.sglang_args",
    "parse_extra_server_args": "dspark_server.backends.sglang_args",
    "sampling_params_to_sglang": "dspark_server.backends.sglang_args",
    "SGLangBackend": "dspark_server.backends.sglang",
    "SGLangUnavailableError": "dspark_server.backends.sglang",
    "require_sglang_runtime": "dspark_server.backends.sglang",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
