"""What a user reads: at 80 columns through a pipe no number in any table is cut and names shorten from the left
keeping their stage; `targets` reads at 80 columns; the header says the tolerance as given; the HTML pages show
no raw markdown and fit a 1200 px window in a real browser; the float32 row names its worst weight; `make demo`
ends with the next command to try."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from rich.console import Console

import cli_runner
import tf32lab as tf32lab_api
from browser import visit
from tf32lab.report.tables import Column, Fitted, as_lines

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(__file__).resolve().with_name("surfaces_models.py")
# a number as the tables print it: 2.75e-04, +1.7e-08, 1.000000, 100.0%, 1.26x, 1125
NUMBER = re.compile(r"(?<![\w.…])[-+]?\d+(?:\.\d+)?(?:e[-+]\d+)?[x%]?(?![\w.])")
CUT = re.compile(r"[^\s│┃]…(?=[\s│┃]|$)", re.M)  # an ellipsis ending a word: something cut from the right


def tf32lab(*args: str, columns: int, cwd: Path, check: bool = True) -> str:
    """The command's stdout through a pipe (as `| cat` sees it), the terminal ``columns`` wide."""
    env = {**os.environ, "COLUMNS": str(columns)}
    env.pop("LINES", None)
    done = cli_runner.run(*args, cwd=cwd, env=env, timeout=600)
    assert done.returncode in ((0,) if check else (0, 1)), done.stderr
    return done.stdout


def numbers(text: str) -> set[str]:
    """The numbers printed, but on lines that time the run (they differ from run to run)."""
    return {n for line in text.splitlines() if not re.search(r"\d s\b", line) for n in NUMBER.findall(line)}


def assert_nothing_cut(wide: str, narrow: str) -> None:
    missing = numbers(wide) - numbers(narrow)
    assert not missing, f"numbers cut at 80 columns: {sorted(missing)}\n{narrow}"
    assert not CUT.search(narrow), narrow
    # the tables and the conclusion fit: only the verdict and warning lines (never wrapped, to grep well) and a
    # command to copy (`next: tf32lab tune <the workload> ...`, as long as the workload's path) may be longer
    wide_lines = [line for line in narrow.splitlines() if len(line) > 80]
    others = [line for line in wide_lines if not line.startswith(("PASSED |", "FAILED |", "warning | ",
                                                                  "next: tf32lab "))]
    assert not others, others
    assert not [line for line in wide_lines if any(c in line for c in "│┃━─")], wide_lines


# the module-scoped fixtures below are built once: the whole file runs on one xdist worker
pytestmark = pytest.mark.xdist_group("test_surfaces")


# -- check, at 80 columns ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def check_runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("check")
    args = ("check", f"{MODELS}:deep", "--no-speed", "--tolerance", "2.5e-4")
    return {width: tf32lab(*args, columns=width, cwd=cwd, check=False) for width in (80, 240)}


def test_check_at_80_columns_cuts_no_number_and_keeps_each_layers_stage(check_runs):
    assert_nothing_cut(check_runs[240], check_runs[80])
    for name in ("regression_logits_of_the_head", "hidden_state_after_the_encoder"):
        assert name in check_runs[80]  # an output's name whole (wrapped if need be), never 'regres…'
    for stage in range(3):
        assert re.search(rf"(…|encoder\.)layer\.{stage}\.", check_runs[80]), check_runs[80]


def test_the_header_says_the_tolerance_as_given(check_runs):
    header = " ".join(check_runs[240].splitlines()[0].split())
    assert "tolerance 2.5e-04 (normwise)" in header and "default tolerance" not in header, header
    # the conclusion too: 2.5e-04, not rounded to 3e-04
    assert "3e-04" not in check_runs[240]


def test_a_defaulted_tolerance_is_called_the_default(tmp_path):
    out = tf32lab("check", "tf32lab.workloads.builtin:covariance", "--no-speed", "--levels", "highest",
                  columns=200, cwd=tmp_path, check=False)
    assert "default tolerance 1e-02" in out.splitlines()[0]


# -- check --train, at 80 columns and in a browser -----------------------------------------------------------------
@pytest.fixture(scope="module")
def train_runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("train")
    # medium computes as high on the default target (a100): its row is named "medium=high"
    args = ("check", f"{MODELS}:deep_training", "--train", "--levels", "highest,high,medium")
    runs = {240: tf32lab(*args, "--json", "t.json", "--html", "t.html", columns=240, cwd=cwd),
            80: tf32lab(*args, columns=80, cwd=cwd)}
    return runs, json.loads((cwd / "t.json").read_text()), cwd


@pytest.fixture(scope="module")
def train_page(train_runs, tmp_path_factory):
    """The training page as the browser shows it: one launch for the tests that read it."""
    _, _, cwd = train_runs
    return visit(cwd / "t.html", tmp_path_factory.mktemp("train_page") / "t.png")


def test_check_train_at_80_columns_cuts_no_number(train_runs):
    runs, _, _ = train_runs
    assert_nothing_cut(runs[240], runs[80])


def test_a_row_computed_as_another_keeps_its_name_on_one_line_at_80_columns(train_runs):
    runs, data, _ = train_runs
    assert data["levels"][-1]["same_as"] == "high"
    for out in runs.values():
        rows = [line for line in out.splitlines() if re.match(r"[│ ]*medium=high\b", line)]
        assert len(rows) == 3, out  # the loss path, the gradients, the weights: each whole on one line


def test_the_float32_row_names_its_worst_weight_in_text_json_and_html(train_runs, train_page):
    runs, data, _ = train_runs
    worst = data["floor"]["weights"][0]  # the JSON lists every parameter, the worst first
    assert worst["normwise"] == max(w["normwise"] for w in data["floor"]["weights"])
    tail = ".".join(worst["name"].split(".")[-4:])  # its end (and stage) survive any shortening
    for width, out in runs.items():
        floor = [line for line in out.splitlines() if re.match(r"[│ ]*float32\b", line) and tail in line]
        assert floor, (width, out)
        assert any(f"{worst['normwise']:.2e}" in line for line in floor), (width, floor)
    row = next(line for line in train_page.text.splitlines() if line.startswith("float32") and worst["name"] in line)
    assert f"{worst['normwise']:.2e}" in row


def test_the_training_page_fits_1200_px_and_shows_no_markdown(train_page):
    seen = train_page
    assert not seen.console_errors and seen.svg_count >= 1
    assert seen.scroll_width <= 1200, seen.scroll_width
    assert "`" not in seen.text and "**" not in seen.text


# -- tune, tune --train ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tune_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("tune")
    out = tf32lab("tune", f"{MODELS}:two_sensitive", "--json", "t.json", "--html", "t.html", columns=80, cwd=cwd)
    return out, json.loads((cwd / "t.json").read_text()), cwd


def test_tune_shows_every_candidate_whole_at_80_columns(tune_run):
    out, data, _ = tune_run
    words = out.split()
    long = [c for c in data["candidates"] if len(c["why"]) > 44]
    assert long, [c["why"] for c in data["candidates"]]  # the search tried a label longer than 44 characters
    for c in data["candidates"]:
        assert all(word in words for word in c["why"].split()), (c["why"], out)  # whole (wrapped), not cut
        assert f"{c['worst_ratio']:.2f}" in words and f"{c['speedup']:.2f}x" in words
    assert not CUT.search(out)
    lines = out.splitlines()
    table = lines[1:next(i for i, line in enumerate(lines) if "end-to-end runs" in line)]
    assert table and max(map(len, table)) <= 80, table


def test_the_tune_page_shows_code_not_backticks_and_fits_1200_px(tune_run, tmp_path):
    _, _, cwd = tune_run
    seen = visit(cwd / "t.html", tmp_path / "tune.png")
    assert not seen.console_errors
    assert "`" not in seen.text and "**" not in seen.text, [line for line in seen.text.splitlines() if "`" in line]
    assert seen.scroll_width <= 1200, seen.scroll_width


def test_tune_train_page_shows_code_not_backticks_and_its_header_the_tolerance(tmp_path):
    out = tf32lab("tune", f"{MODELS}:deep_training", "--train", "--tolerance", "2.5e-4", "--html", "t.html",
                  columns=80, cwd=tmp_path)
    assert "tolerance 2.5e-04" in out.splitlines()[0]
    seen = visit(tmp_path / "t.html", tmp_path / "t.png")
    assert "`" not in seen.text and "**" not in seen.text
    assert seen.scroll_width <= 1200, seen.scroll_width


def test_the_check_page_shows_no_markdown_and_fits_1200_px(tmp_path):
    tf32lab("check", f"{MODELS}:deep", "--no-speed", "--html", "c.html", columns=80, cwd=tmp_path, check=False)
    seen = visit(tmp_path / "c.html", tmp_path / "c.png")
    assert "`" not in seen.text and "**" not in seen.text
    assert seen.scroll_width <= 1200, seen.scroll_width


# -- targets, doctor, policy show ----------------------------------------------------------------------------------
def test_targets_reads_at_80_columns(tmp_path):
    narrow = tf32lab("targets", columns=80, cwd=tmp_path)
    data = json.loads(tf32lab("targets", "--json", columns=80, cwd=tmp_path))
    names = [t["name"] for t in data["targets"]]
    lines = narrow.splitlines()
    starts = [i for i, line in enumerate(lines) if line.split()[:1] and line.split()[0] in names
              and line.startswith(line.split()[0])]
    assert len(starts) == len(names), narrow
    ends = [*starts[1:], next(i for i in range(starts[-1] + 1, len(lines) + 1)
                              if i == len(lines) or not lines[i].startswith(" "))]
    heights = {lines[s].split()[0]: e - s for s, e in zip(starts, ends)}
    assert max(heights.values()) <= 3, heights  # the hardware wraps; the peaks pair never does
    assert max(map(len, lines)) <= 80
    for t in data["targets"]:  # every peak whole, the pair on one line
        if t["peaks"]:
            assert f"{t['peaks']['fp32_tflops']:g}/{t['peaks']['tf32_tflops'] or '-'}" in narrow.split()


def test_targets_says_what_each_math_it_shows_means(tmp_path):
    # tf32-rna, tf32-rz, bf16x3: names a reader meets first in this table, explained under it as doctor's are
    wide = tf32lab("targets", columns=240, cwd=tmp_path)
    data = json.loads(tf32lab("targets", "--json", columns=240, cwd=tmp_path))
    shown = {maths[family] for t in data["targets"] for maths in t["maths"].values() for family in ("matmul", "conv")}
    caption = wide[wide.index("conv follows"):]
    assert {name for name in shown if name not in caption} == set(), caption
    assert "ties away" in caption and "toward zero" in caption, caption


def test_doctor_and_policy_show_cut_nothing_at_80_columns(tmp_path):
    assert_nothing_cut(tf32lab("doctor", "--simulate", "h100", columns=240, cwd=tmp_path),
                       tf32lab("doctor", "--simulate", "h100", columns=80, cwd=tmp_path))
    policy = ROOT / "examples" / "value_head" / "policy.json"
    model = f"{ROOT / 'examples' / 'value_head' / 'train.py'}:workload"
    out = tf32lab("policy", "show", str(policy), "--model", model, columns=80, cwd=tmp_path)
    assert not CUT.search(out) and max(map(len, out.splitlines())) <= 80


# -- the rule itself, for columns a later report adds -----------------------------------------------------------------
def test_a_table_with_more_numbers_than_80_columns_hold_still_cuts_none():
    from tf32lab.report.tables import Column, Fitted

    columns = [Column("level", "text", key=True), Column("layer", "name", key=True),
               *(Column(f"metric {i}") for i in range(9))]
    table = Fitted("many numbers", columns)
    for stage in range(3):
        table.add_row("highest", f"model.encoder.layer.{stage}.attention.output.dense",
                      *(f"{(i + 1) * 1.2345e-4 * (stage + 1):.3e}" for i in range(9)))
    for width in (80, 60):
        console = Console(width=width, color_system=None)
        with console.capture() as captured:
            console.print(table)
        out = captured.get()
        for row in table.rows:
            for cell in row[2:]:
                assert cell in out, (cell, out)
        assert max(map(len, out.splitlines())) <= width
        assert not CUT.search(out)
        for stage in range(3):
            assert f"layer.{stage}." in out


def test_a_title_wider_than_its_narrow_table_wraps_at_the_terminal_not_the_table():
    # the layers table of a small model is three narrow columns: its title broke as "(7 of" / "7)" at 42 columns
    table = Fitted("Layers, most error introduced first (7 of 7): introduced / accumulated",
                   [Column("layer", "name", key=True), Column("highest"), Column("high")])
    table.add_row("blocks.1.attention", "- / 3.6e-07", "3.5e-04 / 4.8e-04")
    lines = as_lines(table, 80)
    assert lines[0] == "Layers, most error introduced first (7 of 7): introduced / accumulated", lines
    assert max(map(len, lines)) <= 80 and any("3.5e-04 / 4.8e-04" in line for line in lines), lines
    narrow = as_lines(table, 50)  # past the terminal's width it wraps there, between words
    assert narrow[:2] == ["Layers, most error introduced first (7 of 7):", "introduced / accumulated"], narrow
    assert max(map(len, narrow)) <= 50
    # a caption too: policy show's legend wrapped at its table's 46 columns
    table = Fitted(None, [Column("module", "name", key=True), Column("level", "text")],
                   caption="*: hooked (its level or conv differs from its parent's); 'from' left empty: inherited "
                           "from the parent")
    table.add_row("(model) *", "high")
    lines = as_lines(table, 80)
    assert lines[-2:] == ["*: hooked (its level or conv differs from its parent's); 'from' left empty:",
                          "inherited from the parent"], lines


def test_names_shorten_from_the_left_keeping_their_stage():
    from tf32lab.report.tables import Column, Fitted, as_lines, short_name

    name = "bert.encoder.layer.11.attention.output.dense"
    for width in range(16, len(name)):
        shown = short_name(name, width)
        assert len(shown) <= width and shown.startswith("…") and shown.endswith("dense"), shown
        assert "11." in shown, shown
    assert short_name(name, 80) == name
    lines = as_lines(Fitted(None, [Column("candidate", "text"), Column("speedup")]), 40)
    assert lines and max(map(len, lines)) <= 40


# -- make demo ---------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_ends_with_the_next_command_to_try():
    done = subprocess.run(["make", "-n", "demo"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    after = done.stdout.split("tf32lab check --html report.html", 2)[-1]  # what runs after the check
    assert re.search(r"echo .*next: .*report\.html", after), done.stdout
    assert re.search(r"echo .*tf32lab tune", after), done.stdout
    assert "exit $status" in after  # the check's exit code, not the echo's


# -- wording and placeholders ------------------------------------------------------------------------------------
def _sgd_training() -> tf32lab_api.TrainingWorkload:
    torch.manual_seed(0)
    data = [(torch.randn(8, 4), torch.randn(8, 1))] * 2
    return tf32lab_api.TrainingWorkload(torch.nn.Linear(4, 1), data, inputs=lambda b: b[0],
                                        loss=lambda o, b: (o - b[1]).pow(2).mean(),
                                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def test_an_optimizer_without_state_shows_a_dash_not_nan():
    report = tf32lab_api.check_training(_sgd_training(), levels=("highest", "high"))
    console = Console(width=120, color_system=None)
    with console.capture() as captured:
        report.print(console)
    text = captured.get()
    assert "opt. state" in text and "nan" not in text, text
    assert "nan" not in report.to_html().split("optimizer state</th>")[1].split("</table>")[0]


def test_a_loss_module_reaching_the_model_is_named_by_its_attribute():
    class Penalised(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.regulariser = model

        def forward(self, output, batch):
            return (output - batch[1]).pow(2).mean() + self.regulariser.weight.abs().sum()

    model = torch.nn.Linear(4, 1)
    data = [(torch.randn(8, 4), torch.randn(8, 1))]
    said = tf32lab_api.TrainingWorkload(model, data, inputs=lambda b: b[0], loss=Penalised(model)).reaching_model()
    assert "'regulariser'" in said and "_modules" not in said and "a dict" not in said, said
    said = tf32lab_api.TrainingWorkload(model, data, inputs=lambda b: model(b[0]) * 0 + b[0],
                                        loss=lambda o, b: (o - b[1]).pow(2).mean()).reaching_model()
    assert said.startswith("the inputs function uses "), said


def test_tune_margin_at_the_tolerance_is_not_rounded_to_1():
    from tf32lab.decide.tune import margin

    assert "1.000" not in margin(0.99996) and "0.99996" in margin(0.99996), margin(0.99996)
    assert "0.997" in margin(0.997)


def test_tune_without_out_says_how_the_command_writes_and_loads_the_policy(tmp_path):
    examples = ROOT / "examples" / "tune"
    (tmp_path / "net.py").write_text(f"import sys\nsys.path.insert(0, {str(examples)!r})\nfrom model import make\n")
    out = tf32lab("tune", "net.py:make", columns=120, cwd=tmp_path)
    assert "tuning.policy" not in out, out  # a Python variable the command's user does not have
    assert "--out FILE" in out and "tf32lab.Policy.load(FILE).apply(model)" in out, out


# -- key and text cells: whole words, names broken only at `_` and `.` --------------------------------------------
LONG_OUTPUT = "classification_logits_for_the_downstream_task_head"


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x):
        y = self.lin(x)
        return {LONG_OUTPUT: y, "output": y * 2}


def _outputs_table(report, width: int) -> list[str]:
    console = Console(width=width, color_system=None, highlight=False)
    with console.capture() as captured:
        report.print(console)
    lines = captured.get().splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("Outputs against the reference"))
    end = next(n for n in range(start + 1, len(lines)) if lines[n] and not lines[n][0].isspace()
               and not lines[n].startswith(("level", "─", "━", "┏", "┃", "┡", "│", "└", *tf32lab_api.LEVELS)))
    return lines[start:end]


@pytest.mark.parametrize("width", [80, 120])
def test_outputs_table_keeps_level_names_whole_and_breaks_names_only_between_parts(width):
    torch.manual_seed(0)
    single = tf32lab_api.check(tf32lab_api.Workload(torch.nn.Linear(64, 32), torch.randn(8, 64), name="lin"),
                               speed=False)
    table = _outputs_table(single, width)
    for level in ("highest", "high", "medium"):
        assert any(re.match(rf"[│ ]*{level}\s", line) for line in table), "\n".join(table)
    torch.manual_seed(0)
    heads = tf32lab_api.check(tf32lab_api.Workload(_TwoHeads(), torch.randn(4, 16), name="heads"), speed=False)
    table = _outputs_table(heads, width)
    pieces = re.split(r"(?<=_)", LONG_OUTPUT)
    whole = {"".join(pieces[i:j]) for i in range(len(pieces)) for j in range(i + 1, len(pieces) + 1)}
    fragments = [token for line in table if not line.startswith("Outputs") for token in re.findall(r"[\w.…]+", line)
                 if len(token) >= 3 and token.strip("…") in LONG_OUTPUT]
    assert fragments and all(token.strip("…") in whole for token in fragments), "\n".join(table)
    assert any(re.match(r"[│ ]*highest\s", line) for line in table), "\n".join(table)


def test_a_pair_stays_on_one_line_and_a_number_header_wraps_before_a_key_folds():
    table = Fitted(None, [Column("target", "text", key=True), Column("hardware", "text"),
                          Column("TFLOP/s", "text", justify="right")])
    table.add_row("a100", "NVIDIA A100 (Ampere), sm80 with a long name to wrap", "19.5 / 156")
    lines = as_lines(table, 30)
    assert any("19.5 / 156" in line for line in lines), lines
    out = tf32lab("targets", columns=80, cwd=ROOT)
    for pair in ("19.5/156", "163.4/653.7", "15.7/-"):
        assert pair in out, out
