"""Demo training corpus: CPython standard library source (code) + the Python documentation (prose).

Sources, both installable on a fresh Debian machine:

* code: the ``*.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), without test suites and ``site-packages``;
* prose: the reStructuredText sources of the Python documentation shipped by the Debian package
  ``python3-doc`` (``apt-get install -y python3-doc`` installs
  ``/usr/share/doc/python3.X/html/_sources/**/*.rst.txt``). The reST markup is lightly cleaned.

Documents are deduplicated by content and split deterministically into train / held-out by the
SHA-256 of their text (about 3 % held out). The output is two JSON-lines files plus a manifest with
file and byte counts. ``/work/shared/prompts`` (evaluation prompts) is never read.

    python -m dspark_server.training.corpus --out work_data/corpus
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

PROSE_PACKAGE = "python3-doc"  # Debian package providing the prose part of the corpus
SKIP_CODE_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class CorpusConfig:
    out_dir: str = "work_data/corpus"
    stdlib_dir: str | None = None  # None: the running interpreter's stdlib
    prose_dir: str | None = None  # None: the python3-doc reST sources (see find_prose_dir)
    heldout_fraction: float = 0.03
    max_code_bytes: int = 300_000  # skip generated giants (e.g. large data tables)
    min_bytes: int = 200


@dataclass(frozen=True)
class Document:
    kind: str  # "code" | "prose"
    name: str  # path relative to its source root
    text: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def is_heldout(doc: Document, fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of the content hash against the held-out fraction."""
    return int(doc.digest[:16], 16) / float(1 << 64) < fraction


def find_prose_dir() -> Path:
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [Path(f"/usr/share/doc/python{ver}/html/_sources")]
    candidates += [Path(p) for p in sorted(glob.glob("/usr/share/doc/python3*/html/_sources"), reverse=True)]
    for c in candidates:
        if c.is_dir() and any(c.rglob("*.rst.txt")):
            return c
    raise FileNotFoundError(
        f"Python documentation sources not found; install them with `apt-get install -y {PROSE_PACKAGE}` "
        "or pass --prose-dir"
    )


def iter_code_documents(
    stdlib_dir: str | Path | None = None, max_bytes: int = 300_000, min_bytes: int = 200
) -> Iterator[Document]:
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_CODE_DIRS for part in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if min_bytes <= len(text.encode("utf-8")) <= max_bytes:
            yield Document("code", str(rel), text)


_ROLE = re.compile(r":(?:[a-zA-Z]+:)?[a-zA-Z]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_{1,2}")
_REF = re.compile(r"`([^`]+)`_{1,2}")
_DIRECTIVE_KEEP = (
    "note",
    "warning",
    "seealso",
    "versionadded",
    "versionchanged",
    "deprecated",
    "impl-detail",
    "tip",
    "important",
)
_HEADING = re.compile(r"^([=\-~^\"'`#*+<>_:.])\1{3,}\s*$")


def clean_rest(text: str) -> str:
    """Strip the heaviest reST markup, keeping prose, headings, and literal/code blocks."""
    out: list[str] = []
    skipping = False  # inside a dropped directive's indented body
    for line in text.splitlines():
        stripped = line.strip()
        if skipping:
            if not stripped or line.startswith((" ", "\t")):
                continue
            skipping = False
        if stripped.startswith(".. "):
            m = re.match(r"\.\.\s+([\w:-]+)::\s*(.*)", stripped)
            if m and m.group(1).split(":")[-1] in _DIRECTIVE_KEEP:
                rest = m.group(2)
                out.append(rest)
                continue
            if m and m.group(1) in ("code-block", "sourcecode", "code", "doctest", "testcode"):
                out.append("")
                continue
            if m and m.group(1).split(":")[-1] in (
                "function",
                "method",
                "class",
                "attribute",
                "data",
                "exception",
                "decorator",
                "classmethod",
                "staticmethod",
                "module",
                "envvar",
                "option",
                "opcode",
                "cmdoption",
                "describe",
                "pdbcommand",
            ):
                out.append(m.group(2))
                continue
            skipping = True  # comments, toctree, index, _targets, images, tables of contents...
            continue
        if (
            stripped.startswith(":")
            and out[-1:] != [""]
            and re.match(r":[\w -]+:", stripped)
            and re.match(r":(synopsis|noindex|platform|deprecated|param|type)", stripped)
        ):
            continue  # field lists of directives (":synopsis:", ":noindex:")
        line = _ROLE.sub(r"\1", line)
        line = _LINK.sub(r"\1", line)
        line = _REF.sub(r"\1", line)
        line = line.replace("``", "`")
        if line.strip() == "::":
            line = ""
        elif line.endswith("::"):
            line = line[:-1]
        if _HEADING.match(line) and (not out or not out[-1].strip()):
            continue  # overline above a title
        out.append(line.rstrip())
    cleaned = "\n".join(out)
    cleaned = re.sub(r"\n{3,}", "\n\n", cleaned)
    return cleaned.strip() + "\n"


def iter_prose_documents(prose_dir: str | Path | None = None, min_bytes: int = 200) -> Iterator[Document]:
    root = Path(prose_dir) if prose_dir else find_prose_dir()
    for path in sorted(root.rglob("*.rst.txt")):
        rel = path.relative_to(root)
        try:
            text = clean_rest(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(text.encode("utf-8")) >= min_bytes:
            yield Document("prose", str(rel), text)


def dedupe(docs: Iterable[Document]) -> Iterator[Document]:
    seen: set[str] = set()
    for d in docs:
        if d.digest not in seen:
            seen.add(d.digest)
            yield d


def split_documents(
    docs: Iterable[Document], heldout_fraction: float
) -> tuple[list[Document], list[Document]]:
    train: list[Document] = []
    held: list[Document] = []
    for d in docs:
        (held if is_heldout(d, heldout_fraction) else train).append(d)
    return train, held


def write_jsonl(docs: Iterable[Document], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"kind": d.kind, "name": d.name, "text": d.text}, ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[Document]:
    docs = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            docs.append(Document(r["kind"], r["name"], r["text"]))
    return docs


def _stats(docs: list[Document]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for d in docs:
        s = out.setdefault(d.kind, {"files": 0, "bytes": 0})
        s["files"] += 1
        s["bytes"] += len(d.text.encode("utf-8"))
    return out


def build_corpus(cfg: CorpusConfig = CorpusConfig()) -> dict:
    """Collect, dedupe, split and write the corpus; returns (and writes) the manifest."""
    stdlib = cfg.stdlib_dir or sysconfig.get_paths()["stdlib"]
    prose = Path(cfg.prose_dir) if cfg.prose_dir else find_prose_dir()
    docs = list(
        dedupe(
            [
                *iter_code_documents(stdlib, cfg.max_code_bytes, cfg.min_bytes),
                *iter_prose_documents(prose, cfg.min_bytes),
            ]
        )
    )
    train, held = split_documents(docs, cfg.heldout_fraction)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(held, out / "heldout.jsonl")
    manifest = {
        "config": asdict(cfg),
        "sources": {
            "code": {"stdlib_dir": str(stdlib), "python": sys.version.split()[0]},
            "prose": {"dir": str(prose), "debian_package": PROSE_PACKAGE},
        },
        "train": _stats(train),
        "heldout": _stats(held),
        "files": {"train": "train.jsonl", "heldout": "heldout.jsonl"},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build the demo corpus (stdlib code + Python docs prose).")
    d = CorpusConfig()
    p.add_argument("--out", default=d.out_dir)
    p.add_argument("--stdlib-dir", default=None)
    p.add_argument("--prose-dir", default=None)
    p.add_argument("--heldout-fraction", type=float, default=d.heldout_fraction)
    a = p.parse_args(argv)
    m = build_corpus(
        CorpusConfig(
            out_dir=a.out, stdlib_dir=a.stdlib_dir, prose_dir=a.prose_dir, heldout_fraction=a.heldout_fraction
        )
    )
    print(json.dumps({k: m[k] for k in ("train", "heldout")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
