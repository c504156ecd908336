"""Run the test suite on every torch in the compatibility matrix, one venv per version; one line per version.

    python scripts/compat.py                      # every version, the committed tree (HEAD), slow tests skipped
    python scripts/compat.py --versions 2.4.1     # one version
    python scripts/compat.py --setup-only         # only create the venvs (the long part: several GB each)
    python scripts/compat.py --doc docs/compat.md # also rewrite the matrix in docs/compat.md

Each venv lives in ``.compat/torch-<version>`` and is created once: ``pip install torch==<version>`` plus the
project's extras. Linux torch wheels on PyPI are CUDA builds that bring their nvidia packages (several GB; no GPU is
needed to import them); 2.13.0 is the pinned torch of ``make test``. The suite runs from a snapshot of a commit
(``git archive``), installed into each venv, so editing the checkout during a run changes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
# Legacy API (allow_tf32 and the level string alone) before 2.9; per-backend fp32_precision cells from 2.9.
VERSIONS = ("2.4.1", "2.6.0", "2.8.0", "2.9.1", "2.11.0", "2.13.0")
EXTRAS = "demo,serving,test"
BEGIN, END = "<!-- compat:begin -->", "<!-- compat:end -->"


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kwargs)


def pins(version: str) -> list[str]:
    """What the venv of one torch pins: the torch itself, and the newest demo stack that still runs on it."""
    major, minor = (int(part) for part in version.split(".")[:2])
    # transformers 5 treats a torch before 2.6 as absent ("PyTorch was not found"), and pip does not know it.
    old = ["transformers<5", "sentence-transformers<5.2"] if (major, minor) < (2, 6) else []
    return [f"torch=={version}", *old]


def api_generation(version: str) -> str:
    major, minor = (int(part) for part in version.split(".")[:2])
    return "per-backend" if (major, minor) >= (2, 9) else "legacy"


def setup(version: str, home: Path) -> Path:
    """The venv for one torch version, created and filled once (a stamp file marks it done)."""
    venv = home / f"torch-{version}"
    stamp = venv / ".installed"
    if stamp.exists():
        return venv
    if venv.exists():
        shutil.rmtree(venv)
    print(f"[compat] torch {version}: creating {venv} (downloads several GB)", flush=True)
    _run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write("\n".join(pins(version)) + "\n")
    try:
        # --no-cache-dir: the wheels are large and each is used once.
        _run([python, "-m", "pip", "install", "--no-cache-dir", "--progress-bar", "off", "-c", constraints.name,
              f"torch=={version}", f"{ROOT}[{EXTRAS}]"])
        _run([python, "-m", "pip", "uninstall", "--quiet", "--yes", "tf32lab"])
    finally:
        os.unlink(constraints.name)
    stamp.write_text(version + "\n")
    return venv


def snapshot(ref: str, home: Path) -> tuple[str, Path]:
    """The tree of ``ref`` extracted once into ``.compat/tree-<sha>``."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", ref], check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = home / f"tree-{sha[:12]}"
    if not (tree / ".complete").exists():
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], check=True, capture_output=True).stdout
        _run(["tar", "-x", "-C", str(tree)], input=archive)
        (tree / ".complete").touch()
    return sha, tree


def _setup_or_none(version: str, home: Path) -> Optional[Path]:
    """The venv of ``version``, or None (said on stderr) when pip could not make it: the other versions go on."""
    try:
        return setup(version, home)
    except subprocess.CalledProcessError as exc:
        print(f"[compat] torch {version}: setting up the venv failed ({exc}); skipped", file=sys.stderr, flush=True)
        return None


def run_suite(venv: Path, tree: Path, slow: bool, extra: list[str]) -> dict:
    python = str(venv / "bin" / "python")
    version = (venv / ".installed").read_text().strip()
    # The snapshot's package, with its pytest plugin entry point, replaces whatever the venv had; a dependency the
    # snapshot added since the venv was made is installed, torch staying pinned.
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write("\n".join(pins(version)) + "\n")
    try:
        _run([python, "-m", "pip", "install", "--quiet", "-c", constraints.name, "-e", f"{tree}[{EXTRAS}]"])
    finally:
        os.unlink(constraints.name)
    torch_version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], check=True,
                                   capture_output=True, text=True).stdout.strip()
    junit = tree / f"junit-{venv.name}.xml"
    junit.unlink(missing_ok=True)  # a run that dies before writing it must not report the last one's counts
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *extra]
    if not slow:
        cmd += ["-m", "not slow"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    # SIGINT at its default: started in the background of a non-interactive shell, the suite would inherit it ignored
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seconds = time.monotonic() - start
    (tree / f"log-{venv.name}.txt").write_text(proc.stdout + proc.stderr)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    if junit.exists():
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
        for case in ET.parse(junit).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    if proc.returncode not in (0, 1) and not failed:  # crashed, interrupted or a usage error: say so
        failed.append(f"pytest exited {proc.returncode} (see {tree / ('log-' + venv.name + '.txt')})")
        counts["errors"] += 1
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr.strip()[-300:]
    return {"torch": torch_version, "exit": proc.returncode, "seconds": round(seconds), "failed": failed,
            "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "summary": re.sub(r"=+", "", summary).strip(), **counts}


def line(version: str, result: dict) -> str:
    verdict = "green" if result["exit"] == 0 else "RED"
    return (f"torch {result['torch']:<16} {api_generation(version):<11} {verdict:<5} "
            f"{result['passed']} passed, {result['failures'] + result['errors']} failed, {result['skipped']} skipped"
            f"  ({result['seconds']} s)")


def write_doc(doc: Path, rows: list[tuple[str, dict]], sha: str, slow: bool) -> None:
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    table = [
        f"Run {date} on commit `{sha[:12]}`, Python {platform.python_version()}, {cpu}, no GPU; "
        f"{'every test' if slow else 'slow tests skipped'}. Command: `python scripts/compat.py --doc docs/compat.md`.",
        "",
        "| torch | flag API | suite | passed | failed | skipped | seconds |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for version, r in rows:
        verdict = "green" if r["exit"] == 0 else f"red (exit {r['exit']})"
        table.append(f"| {r['torch']} | {api_generation(version)} | {verdict} | {r['passed']} | "
                     f"{r['failures'] + r['errors']} | {r['skipped']} | {r['seconds']} |")
    failures = [(r["torch"], name) for _, r in rows for name in r["failed"]]
    if failures:
        table += ["", "Failed tests:", ""] + [f"- torch {t}: `{name}`" for t, name in failures]
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"compat: {doc} has no {BEGIN} ... {END} block to rewrite")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + BEGIN + "\n" + "\n".join(table) + "\n" + END + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", default=",".join(VERSIONS),
                        help=f"comma-separated torch versions (default: {','.join(VERSIONS)})")
    parser.add_argument("--ref", default="HEAD", help="the commit to test (default: HEAD)")
    parser.add_argument("--home", default=str(ROOT / ".compat"), help="where the venvs live (default: .compat)")
    parser.add_argument("--setup-only", action="store_true", help="create the venvs, run nothing")
    parser.add_argument("--slow", action="store_true", help="run the slow tests too")
    parser.add_argument("--doc", help="rewrite the matrix block of this markdown file")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    bad = [v for v in versions if not re.fullmatch(r"\d+\.\d+\.\d+", v)]
    if bad:
        parser.error(f"--versions: {', '.join(bad)} is not a release like 2.4.1")
    if args.doc:
        text = Path(args.doc).read_text() if Path(args.doc).is_file() else ""
        if BEGIN not in text or END not in text:
            parser.error(f"--doc {args.doc}: no {BEGIN} ... {END} block to rewrite")
    home = Path(args.home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    if args.setup_only:
        broken = [v for v in versions if _setup_or_none(v, home) is None]
        return 1 if broken else 0
    sha, tree = snapshot(args.ref, home)
    rows = []
    for version in versions:
        venv = _setup_or_none(version, home)
        if venv is None:
            result = {"torch": version, "exit": "setup failed", "seconds": 0, "failed": ["the venv could not be made"],
                      "passed": 0, "tests": 0, "failures": 0, "errors": 1, "skipped": 0, "summary": "setup failed"}
        else:
            try:
                result = run_suite(venv, tree, args.slow, args.pytest_args)
            except subprocess.CalledProcessError as exc:
                result = {"torch": version, "exit": f"install failed ({exc.returncode})", "seconds": 0,
                          "failed": [f"installing the snapshot failed: {exc}"], "passed": 0, "tests": 0,
                          "failures": 0, "errors": 1, "skipped": 0, "summary": "install failed"}
        rows.append((version, result))
        print(line(version, result), flush=True)
        (home / f"result-{version}.json").write_text(json.dumps({"commit": sha, **result}, indent=1))
    if args.doc:
        write_doc(Path(args.doc), rows, sha, args.slow)
    return 0 if all(r["exit"] == 0 for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
