"""Hugging Face checkpoints -> GGUF with llama.cpp's own converter, for the llama.cpp peer.

The converter (``convert_hf_to_gguf.py`` of a llama.cpp source tree, next to its ``conversion``
package and ``gguf-py``) identifies a BPE tokenizer's pre-tokenizer by hashing how it splits a test
string and refuses hashes it does not list, which a project-trained tokenizer is. The converter
is therefore run through a small wrapper, written to a temporary directory, that imports it and
answers that one question with the pre-tokenizer named here (``qwen2`` by default: byte-level
BPE with the Qwen2 split); nothing in the llama.cpp tree is edited. A DSpark drafter is converted
with ``--target-model-dir`` (the converter reads the target's tokenizer; a temporary copy of the
drafter directory gets the target's tokenizer files). Outputs are cached by the inputs' bytes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dspark_server.bench.common import BenchError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_WRAPPER = '''"""Runs llama.cpp's convert_hf_to_gguf.py with the BPE pre-tokenizer given (argv[2])."""
import runpy
import sys

tree, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
from conversion.base import TextModel  # noqa: E402  the converter's own package

TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [tree + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def find_converter(server_binary: str | Path) -> Path:
    """``convert_hf_to_gguf.py`` of the source tree a llama.cpp binary was built in (the binary
    lives under ``TREE/build/bin``): the nearest parent directory holding it."""
    here = Path(server_binary).resolve().parent
    for d in (here, *here.parents):
        candidate = d / "convert_hf_to_gguf.py"
        if candidate.is_file() and (d / "conversion").is_dir():
            return candidate
    raise BenchError(
        f"no convert_hf_to_gguf.py (with its conversion/ package) above {server_binary}: "
        "pass --llama-converter"
    )


def _cache_key(model_dir: Path, converter: Path, pre: str, target_dir: Path | None) -> str:
    h = hashlib.sha256()
    dirs = [model_dir] + ([target_dir] if target_dir is not None else [])
    for d in dirs:
        for f in sorted(d.iterdir()):
            if f.suffix in (".json", ".safetensors"):
                h.update(f.name.encode())
                h.update(f.read_bytes())
    h.update(converter.read_bytes())
    h.update(pre.encode())
    return h.hexdigest()[:16]


def convert_to_gguf(
    model_dir: str | Path,
    out_dir: str | Path,
    converter: str | Path,
    pre_tokenizer: str = "qwen2",
    target_dir: str | Path | None = None,
    outtype: str = "f32",
) -> Path:
    """The GGUF of ``model_dir`` (a target, or with ``target_dir`` a DSpark drafter for that
    target) in ``out_dir``, converted unless a file for the same inputs is there already."""
    model, conv = Path(model_dir).resolve(), Path(converter).resolve()
    target = Path(target_dir).resolve() if target_dir is not None else None
    out = Path(out_dir) / f"{model.name}-{_cache_key(model, conv, pre_tokenizer, target)}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dspark-gguf-") as tmp:
        wrapper = Path(tmp) / "convert_with_pre_tokenizer.py"
        wrapper.write_text(_WRAPPER)
        src = model
        args = []
        if target is not None:
            src = Path(tmp) / model.name
            shutil.copytree(model, src)
            for name in TOKENIZER_FILES:
                if (target / name).is_file():
                    shutil.copy(target / name, src / name)
            args = ["--target-model-dir", str(target)]
        partial = out.with_suffix(".partial")
        cmd = [sys.executable, str(wrapper), str(conv.parent), pre_tokenizer, str(src), *args]
        cmd += ["--outfile", str(partial), "--outtype", outtype]
        env = {**os.environ, "PYTHONPATH": str(conv.parent / "gguf-py")}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not partial.is_file():
            raise BenchError(f"GGUF conversion of {model} failed:\n{proc.stderr[-3000:]}")
        partial.replace(out)
    return out
