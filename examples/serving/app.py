"""A multi-worker sentence-embedding server: every worker calls ``tf32lab.autoconfig(workers=N)`` as it starts.

Run it (the ``serving`` and ``demo`` extras; ``WEB_CONCURRENCY`` is uvicorn's worker count, read here too):

    WEB_CONCURRENCY=2 uvicorn app:app --app-dir examples/serving --host 127.0.0.1 --port 8000

    curl -s localhost:8000/config                       # this worker's pid, threads, precision, decisions
    curl -s -X POST localhost:8000/embed -d '{"sentences": ["a small bakery"]}'

Why at worker start and not at import: the settings are per process, and importing a module should change nothing
(one server process imports the app before forking or spawning its workers). Each worker gets
usable CPUs // workers threads, so N workers never oversubscribe the CPU quota of their container.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator

import torch
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import tf32lab
from tf32lab.workloads import samples

WORKERS = int(os.environ.get("WEB_CONCURRENCY", "1"))
MAX_SENTENCES = 256


def _show_decisions() -> None:
    """autoconfig logs each decision on the ``tf32lab`` logger; print them beside the server's own lines."""
    logger = logging.getLogger("tf32lab")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     [%(process)d] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    _show_decisions()
    # interop_threads: asked for, since PyTorch allows setting it once per process and this one never undoes
    app.state.decisions = tf32lab.autoconfig(workers=WORKERS, interop_threads="auto")
    app.state.model = samples.minilm()  # all-MiniLM-L6-v2, shipped in a package: nothing is downloaded
    yield


async def config(request: Request) -> JSONResponse:
    decisions = request.app.state.decisions
    return JSONResponse({
        "pid": os.getpid(),
        "workers": WORKERS,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "precision": tf32lab.get_float32_matmul_precision(),
        "decisions": decisions.to_dict()["decisions"],
    })


async def embed(request: Request) -> JSONResponse:
    try:
        body = await request.json()
        sentences = body["sentences"]
    except (ValueError, KeyError, TypeError):
        return JSONResponse({"error": 'send JSON {"sentences": ["...", ...]}'}, status_code=400)
    if not (isinstance(sentences, list) and all(isinstance(s, str) for s in sentences)
            and 0 < len(sentences) <= MAX_SENTENCES):
        return JSONResponse({"error": f"sentences: a list of 1 to {MAX_SENTENCES} strings"}, status_code=400)
    model = request.app.state.model
    # The model runs in a worker thread: the event loop keeps answering while it computes.
    vectors = await run_in_threadpool(model.encode, sentences, convert_to_numpy=False, convert_to_tensor=True)
    return JSONResponse({"pid": os.getpid(), "embeddings": vectors.tolist()})


app = Starlette(routes=[Route("/config", config), Route("/embed", embed, methods=["POST"])], lifespan=lifespan)
