"""Writes are safe: whole or not at all, never through a planted link, modes kept, every error one line (exit 2).

The command line is run as a user runs it, in real subprocesses; a full disk is a real one (a file size limit,
``/dev/full`` for stdout, and a tiny tmpfs where this machine lets a user mount one in its own namespace).
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import threading

import pytest

import cli_runner
import tf32lab
from tf32lab.numbers import files

TINY = '''
import torch


def make():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4), torch.randn(4, 8)
'''


def _run(*args: str, cwd) -> subprocess.CompletedProcess:
    return cli_runner.run(*args, module="tf32lab.cli", timeout=300, cwd=cwd)


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


def _socket_file(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    return sock


def test_what_a_file_cannot_replace_is_refused_naming_the_target(tmp_path):
    (tmp_path / "folder").mkdir()
    sock = _socket_file(tmp_path / "sock")
    (tmp_path / "plain").write_text("")
    cases = {"folder": errno.EISDIR, "sock": errno.EINVAL, "no/such/r.json": errno.ENOENT,
             "plain/r.json": errno.ENOTDIR}
    for name, code in cases.items():
        for attempt in (lambda p: files.write_atomically(p, "x"), files.check_writable):
            with pytest.raises(OSError) as raised:
                attempt(tmp_path / name)
            assert raised.value.errno == code and raised.value.filename == str(tmp_path / name), raised.value
    assert stat.S_ISSOCK((tmp_path / "sock").lstat().st_mode) and (tmp_path / "folder").is_dir()
    assert _leftovers(tmp_path) == []
    sock.close()


def test_a_link_to_an_open_file_of_the_process_is_written_through_and_stays_a_link(tmp_path):
    # /dev/stdout is such a link (to /proc/self/fd/1): renaming over it would replace the system's link
    with open(tmp_path / "out.txt", "w") as out:
        out.write("before\n")
        out.flush()
        (tmp_path / "mystdout").symlink_to(f"/proc/self/fd/{out.fileno()}")
        assert files.is_stream(tmp_path / "mystdout") and files.is_stream("/dev/stdout")
        files.check_writable(tmp_path / "mystdout")
        files.write_atomically(tmp_path / "mystdout", "report\n")
    assert (tmp_path / "mystdout").is_symlink() and (tmp_path / "out.txt").read_text() == "before\nreport\n"
    assert _leftovers(tmp_path) == []
    assert os.path.islink("/dev/stdout") or not os.path.exists("/dev/stdout")


def test_a_named_pipe_and_a_device_are_written_in_place(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    got = []
    reader = threading.Thread(target=lambda: got.append((tmp_path / "fifo").read_text()), daemon=True)
    reader.start()
    files.write_atomically(tmp_path / "fifo", "through the pipe\n")
    reader.join(10)
    assert got == ["through the pipe\n"] and stat.S_ISFIFO((tmp_path / "fifo").lstat().st_mode)
    files.write_atomically("/dev/null", "gone")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert _leftovers(tmp_path) == []


def test_json_to_a_link_to_stdout_lands_in_the_redirected_file(spec_dir, tmp_path):
    (spec_dir / "mystdout").symlink_to("/proc/self/fd/1")
    with open(tmp_path / "out.txt", "w") as out:
        done = cli_runner.run("check", "tiny.py:make", "--json", "mystdout", module="tf32lab.cli", stdout=out,
                              cwd=spec_dir)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "out.txt").read_text()
    assert "PASSED |" in text and '"schema_version"' in text  # the tables, then the report
    assert (spec_dir / "mystdout").is_symlink()


def test_a_link_at_the_target_is_replaced_and_the_file_it_named_left_alone(tmp_path):
    (tmp_path / "real.json").write_text("old\n")
    (tmp_path / "link.json").symlink_to("real.json")
    files.write_atomically(tmp_path / "link.json", "new\n")
    assert not (tmp_path / "link.json").is_symlink() and (tmp_path / "link.json").read_text() == "new\n"
    assert (tmp_path / "real.json").read_text() == "old\n"


def test_the_doctors_json_is_written_safely_too(tmp_path):
    """``Diagnosis.to_json(path)`` went through ``Path.write_text``, which writes through a link at its path."""
    from tf32lab.machine.hardware import Hardware

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


# -- the command line ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ("tune", "tiny.py:make", "--out", "p.json", "--json", "p.json"),
    ("tune", "tiny.py:make", "--out", "p.json", "--html", "./sub/../p.json"),
    ("tune", "tiny.py:make", "--json", "alias.json", "--out", "old.json"),
    ("tune", "tiny.py:make", "--json", "hard.json", "--html", "old.json"),
    ("check", "tiny.py:make", "--json", "r.json", "--html", "r.json"),
    ("check", "tiny.py:make", "--policy", "old.json", "--json", "old.json"),
    ("check", "tiny:make", "--json", "tiny.py"),
    ("speed", "tiny.py:make", "--json", "tiny.py"),
])
def test_one_file_named_twice_is_a_usage_error_before_any_run(spec_dir, args):
    (spec_dir / "sub").mkdir()
    tf32lab.Policy("high").save(spec_dir / "old.json")
    (spec_dir / "alias.json").symlink_to("old.json")
    os.link(spec_dir / "old.json", spec_dir / "hard.json")
    before = {p.name: p.read_bytes() for p in spec_dir.iterdir() if p.is_file()}
    done = _run(*args, cwd=spec_dir)
    line = _one_line_error(done)
    assert "same file" in line or "reads" in line, line
    assert done.stdout == ""  # nothing ran
    assert {p.name: p.read_bytes() for p in spec_dir.iterdir() if p.is_file()} == before


def test_check_never_writes_through_links_planted_at_its_old_temporary_names(spec_dir):
    victim = spec_dir / "victim"
    victim.write_text("precious\n")
    (spec_dir / "planted.py").write_text(
        "import os, sys\npid = os.getpid()\n"
        "for end in ('probe', 'tmp'):\n    os.symlink('victim', f'.r.json.{pid}.{end}')\n"
        "from tf32lab.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    done = cli_runner.run("check", "tiny.py:make", "--json", "r.json", module="planted", cwd=spec_dir)
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == "precious\n"
    assert not (spec_dir / "r.json").is_symlink() and json.loads((spec_dir / "r.json").read_text())["levels"]


def test_out_over_a_private_policy_keeps_it_private(spec_dir):
    (spec_dir / "p.json").write_text("{}")
    (spec_dir / "p.json").chmod(0o600)
    done = _run("tune", "tiny.py:make", "--out", "p.json", cwd=spec_dir)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE((spec_dir / "p.json").stat().st_mode) == 0o600
    tf32lab.Policy.load(spec_dir / "p.json")


@pytest.mark.parametrize("command", [
    ("check", "--json", "out"), ("check", "--html", "out"), ("tune", "--json", "out"), ("tune", "--out", "out"),
    ("tune", "--html", "out"), ("speed", "--json", "out"),
])
def test_a_full_disk_is_one_line_exit_2_and_the_old_file_stays(spec_dir, command):
    """A file size limit (RLIMIT_FSIZE): the kernel refuses the write (EFBIG) as a full disk would, for any user."""
    name, flag, out = command
    (spec_dir / out).write_text("old\n")
    (spec_dir / "limited.py").write_text(
        "import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))\nfrom tf32lab.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    done = cli_runner.run(name, "tiny.py:make", flag, out, module="limited", cwd=spec_dir)
    assert _one_line_error(done) == f"tf32lab {name}: error: cannot write out: {os.strerror(errno.EFBIG)}"
    assert (spec_dir / out).read_text() == "old\n"
    assert _leftovers(spec_dir) == []


def _tmpfs_works() -> bool:
    if not shutil.which("unshare") or not sys.platform.startswith("linux"):
        return False
    done = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                          capture_output=True, timeout=60)
    return done.returncode == 0


@pytest.mark.skipif(not _tmpfs_works(), reason="this machine lets no user mount a tmpfs in its own namespace")
def test_a_really_full_disk(spec_dir):
    """A 64 KiB tmpfs, filled up, in a mount namespace of the test's own (``unshare -rm``: no root needed where
    user namespaces are allowed); the commands write to it for real and meet ENOSPC. Each runs in a process of its
    own, forked from a CLI server started in that namespace (one interpreter's start-up, not one per command)."""
    disk = spec_dir / "disk"
    disk.mkdir()
    (spec_dir / "listing.py").write_text("import os\nprint(' '.join(sorted(os.listdir('disk'))))\n")
    setup = " && ".join([f"mount -t tmpfs -o size=64k tmpfs {shlex.quote(str(disk))}",
                         f"echo old > {shlex.quote(str(disk / 'r.json'))}",
                         f"{{ dd if=/dev/zero of={shlex.quote(str(disk / 'fill'))} bs=4k 2>/dev/null; true; }}",
                         'exec "$0" "$@"'])
    commands = ["check tiny.py:make --json disk/r.json", "tune tiny.py:make --json disk/r.json",
                "speed tiny.py:make --json disk/r.json", "tune tiny.py:make --out disk/r.json"]
    with cli_runner.server(["unshare", "-rm", "sh", "-c", setup]) as inside:
        for command in commands:
            done = cli_runner.run(*command.split(), module="tf32lab.cli", cwd=spec_dir, server=inside)
            assert "Traceback" not in done.stderr
            assert done.stderr.strip().splitlines() == [
                f"tf32lab {command.split()[0]}: error: cannot write disk/r.json: {os.strerror(errno.ENOSPC)}"
            ], done.stderr
            assert done.returncode == 2, (command, done.returncode)
            listing = cli_runner.run(module="listing", cwd=spec_dir, server=inside)
            assert listing.stdout.split() == ["fill", "r.json"], listing  # no temporary left, the tmpfs seen
    assert os.listdir(disk) == []  # the tmpfs was the namespace's own


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("args", [
    ("levels",), ("doctor",), ("doctor", "--json"), ("check", "tiny.py:make", "--json", "-"),
    ("tune", "tiny.py:make", "--json", "-"), ("speed", "tiny.py:make"),
])
def test_stdout_on_a_full_disk_is_one_line_exit_2(spec_dir, args):
    with open("/dev/full", "w") as full:
        done = cli_runner.run(*args, module="tf32lab.cli", stdout=full, cwd=spec_dir)
    assert _one_line_error(done) == f"tf32lab {args[0]}: error: cannot write to stdout: {os.strerror(errno.ENOSPC)}"


@pytest.mark.parametrize("command", ["check", "tune", "speed"])
def test_output_paths_are_checked_before_the_model_runs(spec_dir, command):
    (spec_dir / "folder").mkdir()
    sock = _socket_file(spec_dir / "sock")
    for out, message in (("folder", "is a folder"), ("sock", "is not a regular file"),
                         ("no/r.json", "no folder 'no'"), ("tiny.py/r.json", "no folder 'tiny.py' (it is a file)")):
        done = _run(command, "tiny.py:make", "--json", out, cwd=spec_dir)
        assert _one_line_error(done).startswith(f"tf32lab {command}: error: --json {out}: {message}")
        assert done.stdout == ""  # before the model ran
    assert stat.S_ISSOCK((spec_dir / "sock").lstat().st_mode) and (spec_dir / "folder").is_dir()
    sock.close()


def test_a_closed_stdout_and_a_full_stderr_keep_exit_code_2(spec_dir):
    closed = cli_runner.run("targets", module="tf32lab.cli", stdout=cli_runner.CLOSED, cwd=spec_dir)
    assert _one_line_error(closed) == "tf32lab targets: error: cannot write to stdout: it is closed"
    with open("/dev/full", "w") as full:
        bad = cli_runner.run("check", "tiny.py:make", "--target", "nope", module="tf32lab.cli", stderr=full,
                             cwd=spec_dir)
    assert bad.returncode == 2 and bad.stdout == ""


@pytest.mark.parametrize("unbuffered", ["1", None])
def test_a_full_stderr_keeps_exit_code_2_with_stderr_buffered_or_not(spec_dir, unbuffered):
    # without PYTHONUNBUFFERED the unwritten line stayed in stderr's buffer, and Python's flush at exit failed
    # again: exit 120, not 2
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    with open("/dev/full", "w") as full:
        bad = cli_runner.run("check", "tiny.py:make", "--target", "nope", module="tf32lab.cli", stderr=full,
                             cwd=spec_dir, env=env)
    assert bad.returncode == 2 and bad.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["check", "tiny.py:make", "--json", ""], "--json '': give a file name, or - for standard output"),
    # --html takes no "-" (the page goes to a file): its empty value does not suggest one
    (["check", "tiny.py:make", "--html", ""], "--html '': give a file name (the page goes to a file)"),
    (["tune", "tiny.py:make", "--out", "p.yaml"], "--out p.yaml: a policy is written as JSON (.json, or no suffix) "
                                                  "or TOML (.toml), not '.yaml'"),
    (["tune", "tiny.py:make", "--json", "-", "--out", "/dev/stdout"], "--out /dev/stdout and --json - name the "
                                                                      "same file"),
])
def test_outputs_that_cannot_mean_what_was_asked_are_usage_errors(spec_dir, args, message):
    done = _run(*args, cwd=spec_dir)
    assert message in _one_line_error(done) and done.stdout == ""
    assert not (spec_dir / "p.yaml").exists()
