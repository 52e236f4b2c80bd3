"""Mutation gate: every mutation in table.py must turn its tests red.

For each mutation: copy the package to a scratch directory, apply the edits (each old text must
occur exactly once among its glob's files, else the gate fails and names it), run the mutation's
tests against the copy (PYTHONPATH puts it first) and require pytest to report test failures
(exit status 1; a collection or usage error is not a detection). Prints, per mutation, the tests
that failed and the p-values their messages give. Exit status 0 only if every mutation is caught.

    python tests/mutations/run.py [--only NAME ...] [--baseline] [--jobs N]

``--baseline`` first runs every listed test unmutated (they must pass): CI's pytest run already
does, so the gate skips it there.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table import MUTATIONS, Edit, Mutation  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "dspark_server"
# pytest --tb=line: one "path:line: message" per failure (the distribution tests put p-values there)
FAILURE_LINE = re.compile(r"^/\S+\.py:\d+: (.*)$", re.M)


class GateError(RuntimeError):
    pass


@dataclass(frozen=True)
class Verdict:
    mutation: Mutation
    caught: bool
    failed: list[str]
    messages: list[str]
    seconds: float
    tail: str


def apply_edit(scratch: Path, edit: Edit, mutation: str) -> Path:
    files = sorted(p for p in scratch.glob(edit.glob) if p.is_file())
    hits = [(p, p.read_text().count(edit.old)) for p in files]
    hits = [(p, n) for p, n in hits if n]
    if len(hits) != 1 or hits[0][1] != 1:
        where = ", ".join(f"{p.relative_to(scratch)} ({n}x)" for p, n in hits) or "nowhere"
        raise GateError(
            f"mutation {mutation!r}: the text to replace must occur exactly once in {edit.glob}, "
            f"found {where}. The code moved or changed: update tests/mutations/table.py.\n"
            f"text: {edit.old!r}"
        )
    path = hits[0][0]
    path.write_text(path.read_text().replace(edit.old, edit.new))
    return path


def run_tests(tests: tuple[str, ...], package_root: Path) -> tuple[int, str, float]:
    """pytest on ``tests`` with ``package_root``'s package imported, ahead of the checkout's own
    (pyproject's ``pythonpath = ["."]`` would put the checkout first: its plugin is turned off)."""
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:python_path", "-rf", "--tb=line", *tests]
    bootstrap = (
        f"import sys; sys.path.insert(0, {str(package_root)!r}); import {PACKAGE}; "
        f"assert {PACKAGE}.__file__.startswith({str(package_root)!r}), 'imported ' + {PACKAGE}.__file__; "
        f"import pytest; sys.exit(pytest.main({args!r}))"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(package_root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", bootstrap], cwd=ROOT, env=env, capture_output=True, text=True
    )
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def prepare(mutation: Mutation, source: Path, scratch_root: Path) -> Path:
    """A scratch copy of the package with the mutation's edits applied."""
    scratch = scratch_root / mutation.name
    shutil.copytree(
        source / PACKAGE, scratch / PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    for edit in mutation.edits:
        path = apply_edit(scratch, edit, mutation.name)
        compile(path.read_text(), str(path), "exec")  # a mutation that does not parse detects nothing
    return scratch


def evaluate(mutation: Mutation, scratch: Path) -> Verdict:
    rc, out, seconds = run_tests(mutation.tests, scratch)
    failed = sorted({m.group(1) for m in re.finditer(r"^FAILED (\S+)", out, re.M)})
    messages = [m.group(1)[:400] for m in FAILURE_LINE.finditer(out)]
    return Verdict(mutation, rc == 1 and bool(failed), failed, messages, seconds, out[-3000:])


def report(verdict: Verdict) -> None:
    status = "caught" if verdict.caught else "SURVIVED"
    print(f"{status:9} {verdict.mutation.name:32} {verdict.seconds:4.0f} s  {verdict.mutation.description}")
    for test in verdict.failed:
        print(f"          red: {test}")
    for message in verdict.messages:
        print(f"          | {message}")
    if not verdict.caught:
        print(verdict.tail)
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="*", help="mutation names to run (default: all)")
    parser.add_argument("--baseline", action="store_true", help="first run the listed tests unmutated")
    parser.add_argument("--jobs", type=int, default=2, help="mutations tested at once (default 2)")
    parser.add_argument(
        "--source", type=Path, default=ROOT, help=f"directory holding the {PACKAGE} to mutate"
    )
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.only and len(chosen) != len(set(args.only)):
        known = ", ".join(m.name for m in MUTATIONS)
        print(f"unknown mutation in {args.only}; known: {known}", file=sys.stderr)
        return 2
    if args.baseline:
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        rc, out, seconds = run_tests(tests, args.source)
        print(f"baseline: {len(tests)} test targets, exit {rc}, {seconds:.0f} s")
        if rc != 0:
            print(out[-5000:])
            print("mutation gate: the unmutated tests fail; fix them first", file=sys.stderr)
            return 1
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mutations-") as tmp:
        try:  # every edit applies before any test runs: a stale table fails at once
            scratches = [prepare(m, args.source, Path(tmp)) for m in chosen]
        except GateError as exc:
            print(f"mutation gate: {exc}", file=sys.stderr)
            return 1
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            verdicts = []
            for verdict in pool.map(evaluate, chosen, scratches):
                report(verdict)
                verdicts.append(verdict)
    survivors = [v.mutation.name for v in verdicts if not v.caught]
    total = time.perf_counter() - started
    if survivors:
        print(
            f"mutation gate: {len(survivors)} mutation(s) survived: {', '.join(survivors)}", file=sys.stderr
        )
        return 1
    print(f"mutation gate: all {len(verdicts)} mutations caught ({total:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
