"""examples/serving: a real uvicorn server with 2 worker processes, each configured by autoconfig(workers=2)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tf32lab.machine import hardware

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
# the server's workers import sentence-transformers, this file does not: found, not imported (4 CPU seconds with
# transformers' Trainer, on every pytest-xdist worker that collects this file)
if importlib.util.find_spec("sentence_transformers") is None:
    pytest.skip("could not import 'sentence_transformers'", allow_module_level=True)

APP_DIR = Path(__file__).resolve().parents[1] / "examples" / "serving"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def _post(url: str, body: object) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


@pytest.mark.slow
def test_two_workers_each_take_their_share_of_the_cpus():
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "WEB_CONCURRENCY": "2", "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)
    env.pop("MKL_NUM_THREADS", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "app:app", "--app-dir", str(APP_DIR), "--host", "127.0.0.1",
         "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    workers: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + 180
        # Connections are spread over the workers by the kernel: ask until both have answered.
        while len(workers) < 2 and time.monotonic() < deadline and server.poll() is None:
            try:
                answer = _get(f"{base}/config")
                workers[answer["pid"]] = answer
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        assert len(workers) == 2, f"saw workers {list(workers)}"
        assert server.pid not in workers  # the supervisor serves nothing itself

        expected = max(1, hardware.detect().usable_cpus // 2)
        for answer in workers.values():
            assert answer["workers"] == 2
            assert answer["threads"] == expected and answer["interop_threads"] == expected
            assert answer["precision"] == "highest"  # no TF32 on a machine without a GPU with capability >= 8.0
            threads = next(d for d in answer["decisions"] if d["setting"] == "threads")
            assert threads["new"] == expected and "2 worker(s)" in threads["reason"]

        status, answer = _post(f"{base}/embed", {"sentences": ["a small bakery", "a tired engineer"]})
        assert status == 200 and answer["pid"] in workers
        assert len(answer["embeddings"]) == 2 and len(answer["embeddings"][0]) == 384
        status, answer = _post(f"{base}/embed", {"sentences": "not a list"})
        assert status == 400 and "sentences" in answer["error"]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            output, _ = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            output, _ = server.communicate()
    assert server.returncode == 0, output[-3000:]
    for pid in workers:  # each worker logged its decisions through the tf32lab logger
        assert f"[{pid}] autoconfig: threads:" in output
