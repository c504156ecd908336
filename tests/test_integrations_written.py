"""The callbacks' report files (`tf32lab.integrations.written.Written`) and the training report's plain data they are
rendered from: the same texts as `to_json()` and `to_html()`, made from one `to_dict()` in the caller's thread, and
written by the writer thread."""

from __future__ import annotations

import json
import random

import pytest
import torch

import tf32lab
from tf32lab.integrations.written import Written
from tf32lab.report.training import TrainingReport


@pytest.fixture(scope="module")
def report() -> TrainingReport:
    torch.manual_seed(0)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(2)]
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    workload = tf32lab.TrainingWorkload(model, data, loss=lambda out, b: (out - b[1]).pow(2).mean(),
                                        inputs=lambda b: b[0], name="mlp")
    return tf32lab.check_training(workload, levels=("highest", "high"), target="h100")


def test_the_files_are_the_reports_own_texts_from_one_to_dict(report, tmp_path, monkeypatch):
    made = []
    to_dict = TrainingReport.to_dict

    def counted(self):
        made.append(1)
        return to_dict(self)

    monkeypatch.setattr(TrainingReport, "to_dict", counted)
    state = random.getstate()
    paths = Written(report, str(tmp_path / "logs")).wait()
    assert random.getstate() == state  # the run's Python stream as it was
    assert [p.name for p in paths] == ["tf32lab-training.json", "tf32lab-training.html"]
    assert len(made) == 1  # one to_dict for both texts (the page made its own for two constants)
    monkeypatch.setattr(TrainingReport, "to_dict", to_dict)
    assert paths[0].read_text(encoding="utf-8") == report.to_json()
    assert paths[1].read_text(encoding="utf-8") == report.to_html()


def test_a_rows_plain_data_is_its_own(report):
    """Rows are turned into dicts field by field (no deep copy): every container of the data is new all the same,
    so that editing the data leaves the report as it was."""
    data = report.to_dict()
    high = data["levels"][1]
    assert high["level"] == "high" and high["maths"] and high["gradients"]
    high["maths"].clear()
    high["gradients"][0]["name"] = "edited"
    high["losses"].append(0.0)
    row = report.level("high")
    assert row.maths and row.gradients[0].name != "edited" and len(row.losses) == report.steps
    assert json.loads(report.to_json()) == report.to_dict()


def test_both_files_are_synced_with_one_flush_of_their_folder(report, tmp_path, monkeypatch):
    """Each file is flushed to disk before its rename, and the folder once after both renames (a folder's flush is
    a journal commit: milliseconds of the writer thread's waiting, which a short run then waits for)."""
    import os
    import stat

    from tf32lab.numbers import files

    synced: list[str] = []
    fsync = os.fsync

    def counted(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        fsync(fd)

    monkeypatch.setattr(files.os, "fsync", counted)
    paths = Written(report, str(tmp_path)).wait()
    assert synced == ["file", "file", "folder"]
    assert paths[0].read_text(encoding="utf-8") == report.to_json()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tf32lab-training.html", "tf32lab-training.json"]


def test_the_json_is_made_from_the_reports_finite_data_without_a_second_walk(report, tmp_path, monkeypatch):
    """`to_dict()` is finite already (its own `finite` walk): the writer makes the JSON text of it as it is, the
    same text as `to_json()`, without `write_json`'s second walk of it (a quarter of the JSON's making)."""
    from tf32lab.numbers import files
    from tf32lab.report import training

    walks = []
    finite = files.finite

    def counted(data):
        if isinstance(data, dict) and "levels" in data:  # a walk of the whole report (it recurses)
            walks.append(1)
        return finite(data)

    for module in (files, training):
        monkeypatch.setattr(module, "finite", counted)
    paths = Written(report, str(tmp_path)).wait()
    assert len(walks) == 1  # to_dict's own
    monkeypatch.undo()
    assert paths[0].read_text(encoding="utf-8") == report.to_json()


def test_a_page_that_cannot_be_rendered_leaves_the_json_synced_with_its_folder(report, tmp_path, monkeypatch):
    """The folder's one flush comes after both files: a page whose rendering raised left the JSON renamed but its
    rename not flushed, where each file written alone was (the error is warned of, the JSON kept)."""
    import os
    import stat

    from tf32lab.numbers import files
    from tf32lab.report import training_render

    synced: list[str] = []
    fsync = os.fsync

    def counted(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        fsync(fd)

    def unrenderable(*args, **kwargs):
        raise RuntimeError("no page")

    monkeypatch.setattr(files.os, "fsync", counted)
    monkeypatch.setattr(training_render, "html", unrenderable)
    written = Written(report, str(tmp_path))
    with pytest.warns(UserWarning, match="no page"):
        assert written.wait() == []
    assert synced == ["file", "folder"]
    assert (tmp_path / "tf32lab-training.json").read_text(encoding="utf-8") == report.to_json()


def test_the_texts_are_rendered_before_the_run_trains_on(report, tmp_path, monkeypatch):
    """Rendering is Python that holds the GIL: in the writer thread it held it against the run's own steps (a small
    model's loop, Python between short ops, paid more than the rendering's own time); it is done in the caller's
    thread, before Written returns, and the thread only writes."""
    import threading

    threads: list[str] = []
    to_dict = TrainingReport.to_dict

    def seen(self):
        threads.append(threading.current_thread().name)
        return to_dict(self)

    monkeypatch.setattr(TrainingReport, "to_dict", seen)
    written = Written(report, str(tmp_path))
    assert threads == [threading.current_thread().name]
    monkeypatch.undo()
    assert [p.read_text(encoding="utf-8") for p in written.wait()] == [report.to_json(), report.to_html()]


def test_the_run_goes_on_while_the_writer_waits_on_the_disk(report, tmp_path, monkeypatch):
    # Thread.start() waits until the thread has started; a writer that then ran Python held the GIL until the
    # interpreter's switch interval made it let go (5 ms by default, a twentieth of a small model's check); and
    # the disk's syncs (tens of milliseconds on a slow one) are waited for in the thread, not by the run
    import os
    import sys
    import time

    from tf32lab.numbers import files

    # Written imports the page's renderer and compiles its template once a process (0.05 to 0.7 s on a loaded
    # 2-core machine): done here first, the clock times the writer's start alone
    Written(report, str(tmp_path / "first")).wait()
    fsync = os.fsync
    syncing = []

    def slow(fd: int) -> None:  # a slow disk
        syncing.append(1)
        time.sleep(0.1)
        fsync(fd)

    monkeypatch.setattr(files.os, "fsync", slow)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # a writer that keeps the GIL keeps it for a second
    try:
        started = time.perf_counter()
        written = Written(report, str(tmp_path))
        returned = time.perf_counter() - started
        assert written.wait()
    finally:
        sys.setswitchinterval(interval)
    assert len(syncing) == 3 and returned < 0.25, returned


def test_an_interrupt_in_start_leaves_no_writer_waiting(report, tmp_path, monkeypatch):
    """Ctrl-C that lands in ``Thread.start()`` (its wait for the thread to start) comes after the thread has started:
    the writer, not a daemon, waited for a signal that start() never gave, and the process could not exit."""
    import threading

    start = threading.Thread.start
    started: list[threading.Thread] = []

    def interrupted(self) -> None:
        start(self)
        started.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Written(report, str(tmp_path))
    monkeypatch.undo()
    (writer,) = started
    writer.join(timeout=10)
    assert not writer.is_alive()
