"""Writes are safe: whole or not at all, never through a planted link, modes kept."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import threading

import pytest

import tf32lab
from tf32lab import files

TINY = '''
import torch


def make():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4), torch.randn(4, 8)
'''


def _run(*args: str, cwd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tf32lab.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, **kw)


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture()
def spec_dir(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    return tmp_path


# -- the API -------------------------------------------------------------------------------------------------------
def test_a_link_planted_at_a_temporary_name_is_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    # the name the temporary file used to have (predictable: the process id) ...
    (tmp_path / f".p.json.{os.getpid()}.tmp").symlink_to(victim)
    tf32lab.Policy("high", [("head", "highest")]).save(tmp_path / "p.json")
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "p.json").is_symlink()
    assert tf32lab.Policy.load(tmp_path / "p.json") == tf32lab.Policy("high", [("head", "highest")])
    # ... and whatever name is drawn now: anything already there, a dangling link included, is never opened
    for name in ("link", "dangling"):
        (tmp_path / name).symlink_to(victim if name == "link" else tmp_path / "nowhere")
        with pytest.raises(FileExistsError):
            files._open_new(tmp_path / name, 0o600)
    assert victim.read_text() == "precious\n" and not (tmp_path / "nowhere").exists()


def test_concurrent_saves_of_one_path_never_collide(tmp_path):
    path = tmp_path / "p.json"
    policies = [tf32lab.Policy("high", [(f"layer{t}", "highest")]) for t in range(8)]
    errors: list[BaseException] = []

    def save(policy):
        try:
            for _ in range(60):
                policy.save(path)
                assert tf32lab.Policy.load(path) in policies  # complete, whichever thread wrote last
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(p,)) for p in policies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tf32lab.Policy.load(path) in policies
    assert _leftovers(tmp_path) == []


def test_an_existing_targets_mode_is_kept_and_a_new_file_gets_the_umask(tmp_path):
    for mode in (0o600, 0o640, 0o444 if os.geteuid() == 0 else 0o604):
        path = tmp_path / f"{mode:o}.json"
        path.write_text("old\n")
        path.chmod(mode)
        tf32lab.Policy("high").save(path)
        assert stat.S_IMODE(path.stat().st_mode) == mode and tf32lab.Policy.load(path) == tf32lab.Policy("high")
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(files.write_atomically(tmp_path / "new", "x").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(files.write_atomically(tmp_path / "private", "x", private=True).stat().st_mode) == 0o600
    (tmp_path / "shared").write_text("old")
    (tmp_path / "shared").chmod(0o664)
    assert stat.S_IMODE(files.write_atomically(tmp_path / "shared", "x", private=True).stat().st_mode) == 0o600


def test_what_a_file_cannot_replace_is_refused_naming_the_target(tmp_path):
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "plain").write_text("")
    cases = {"folder": errno.EISDIR, "fifo": errno.EINVAL, "no/such/r.json": errno.ENOENT,
             "plain/r.json": errno.ENOTDIR}
    for name, code in cases.items():
        for attempt in (lambda p: files.write_atomically(p, "x"), files.check_writable):
            with pytest.raises(OSError) as raised:
                attempt(tmp_path / name)
            assert raised.value.errno == code and raised.value.filename == str(tmp_path / name), raised.value
    assert stat.S_ISFIFO((tmp_path / "fifo").lstat().st_mode) and (tmp_path / "folder").is_dir()
    assert _leftovers(tmp_path) == []


def test_a_link_at_the_target_is_replaced_and_the_file_it_named_left_alone(tmp_path):
    (tmp_path / "real.json").write_text("old\n")
    (tmp_path / "link.json").symlink_to("real.json")
    files.write_atomically(tmp_path / "link.json", "new\n")
    assert not (tmp_path / "link.json").is_symlink() and (tmp_path / "link.json").read_text() == "new\n"
    assert (tmp_path / "real.json").read_text() == "old\n"


def test_the_doctors_json_is_written_safely_too(tmp_path):
    """``Diagnosis.to_json(path)`` went through ``Path.write_text``, which writes through a link at its path."""
    from tf32lab.hardware import Hardware

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "d.json").symlink_to(victim)
    tf32lab.doctor(Hardware.simulated("a100")).to_json(tmp_path / "d.json")
    assert victim.read_text() == "precious\n" and json.loads((tmp_path / "d.json").read_text())["levels"]


def test_a_long_name_gets_a_temporary_name_that_fits(tmp_path):
    name = "r" * 250 + ".json"
    assert files.write_atomically(tmp_path / name, "x").read_text() == "x"
    files.check_writable(tmp_path / name)
    assert _leftovers(tmp_path) == []


def test_check_writable_leaves_the_target_alone(tmp_path):
    (tmp_path / "r.json").write_text("old\n")
    files.check_writable(tmp_path / "r.json")
    files.check_writable(tmp_path / "new.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"] and (tmp_path / "r.json").read_text() == "old\n"


def test_same_file_sees_spellings_links_and_hard_links(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.json").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "alias.json").symlink_to("a.json")
    os.link(tmp_path / "a.json", tmp_path / "hard.json")
    assert files.same_file("a.json", "./a.json") and files.same_file("a.json", "sub/../a.json")
    assert files.same_file("a.json", tmp_path / "a.json") and files.same_file("new.json", "./sub/../new.json")
    assert files.same_file("alias.json", "a.json") and files.same_file("hard.json", "a.json")
    assert not files.same_file("a.json", "b.json") and not files.same_file("new.json", "sub/new.json")
