"""The generation check: greedy decoding at each level against float64's tokens, beside float32's own.

A small decoder trained here on the sample sentences (random weights give near-uniform logits, and every row
diverges at once) shows a finite, reproducible divergence at `high` and none, or a later one, at `highest`. It is
trained in float64 and then narrowed, but its weights are still not the same bits on every CPU: float64 sums run
in another order on another instruction set, and a few hundred Adam steps carry a last-bit difference into another
model (trained 150 steps with ATen's and oneDNN's SSE4 kernels, its loss on the prompts was 1.42 instead of 1.58,
and `high` left other prompts at other steps). So the tests assert what any such model shows, never one CPU's
steps or bits; ``scripts/cpu_kinds.py`` reruns them under other instruction sets (docs/design.md, "The test
suite")."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import torch

import cli_runner
import tf32lab
from tf32lab.errors import Tf32LabError
from tf32lab.report.generation import Criterion, generation_schema
from tf32lab.workloads import samples
from tf32lab.workloads.hf import CausalLM

pytestmark = pytest.mark.xdist_group("hf_cli")  # with test_hf_folders.py: one server that imported transformers

TEXT = "\n".join(samples.SENTENCES) + "\n"
CHARS = sorted(set(TEXT))
STEPS = 300
OUTLIER = 8000.0


class Window(torch.nn.Module):
    """A causal character model: each position's logits from the embeddings of its last ``k`` characters.

    Its hidden state carries one feature far larger than the rest, as language models' do ("massive
    activations", Sun et al., arXiv:2402.17762): the product with its weight is where TF32's rounding of the
    weights shows in the logits, as it does in real decoders."""

    def __init__(self, vocab: int, k: int = 5, width: int = 16, hidden: int = 256, massive: float = OUTLIER) -> None:
        super().__init__()
        self.k, self.massive = k, massive
        self.embed = torch.nn.Embedding(vocab, width)
        self.hidden = torch.nn.Linear(k * width, hidden)
        self.out = torch.nn.Linear(hidden + 1, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = torch.nn.functional.pad(self.embed(ids), (0, 0, self.k - 1, 0))
        window = torch.cat([e[:, i:i + ids.shape[1]] for i in range(self.k)], dim=-1)
        h = torch.tanh(self.hidden(window))
        return self.out(torch.cat([h, torch.full_like(h[..., :1], self.massive)], dim=-1))


def _ids(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


@pytest.fixture(scope="session")
def trained() -> Window:
    """The decoder after a few hundred float64 Adam steps on the sentences, narrowed to float32."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared CPU: one thread is faster than several fighting for it
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Window(len(CHARS)).double()
            data = torch.tensor(_ids(TEXT))
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
            for _ in range(STEPS):
                starts = torch.randint(0, len(data) - 65, (16,))
                x = torch.stack([data[s:s + 64] for s in starts])
                y = torch.stack([data[s + 1:s + 65] for s in starts])
                loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, len(CHARS)), y.reshape(-1))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.float().eval()


def _tails() -> list[str]:
    # sentence ends, all of one length (one batch): the next sentence's subject, then its ending, are where the
    # text goes on several ways equally often, and the logits come closest to a tie
    return sorted({s[-12:] for s in samples.SENTENCES})


def _prompts() -> list[list[int]]:
    return [_ids(tail) for tail in _tails()]


class Chars:
    """The trained decoder's tokenizer: one id per character of the sample text; any other character reads as a
    space (so that a prompt may hold what the text never does, ``<`` or ``&``)."""

    pad_token_id = None  # the decoder takes no mask: prompts of one length are decoded together

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [CHARS.index(c if c in CHARS else " ") for c in text]}

    def decode(self, ids: list[int]) -> str:
        return "".join(CHARS[i] for i in ids)


def _with_text(model: Window) -> CausalLM:
    return CausalLM(model, Chars(), "window")


def test_a_trained_decoder_leaves_float64s_tokens_at_high_and_not_earlier_at_highest(trained):
    report = tf32lab.check_generation(trained, new_tokens=32, prompts=_prompts(), levels=("highest", "high"))
    high, floor = report.level("high"), report.floor
    assert high.first is not None and 1 <= high.first <= 32  # a finite divergence step at high
    assert floor.first is None or floor.first > high.first  # none, or a later one, at highest
    assert high.worst_logit_error > 100 * floor.worst_logit_error  # TF32's error far above float32's own
    assert report.level("highest").divergence == floor.divergence  # float32 `highest` is the floor row
    assert not report.passed  # the default criterion: every new token float64's
    again = tf32lab.check_generation(trained, new_tokens=32, prompts=_prompts(), levels=("high",))
    assert again.level("high").divergence == high.divergence  # reproducible
    assert again.level("high").tokens == high.tokens
    # the criteria judge the same numbers
    first = high.first
    assert not Criterion.parse(f"divergence>={first + 1}", 32).passes(high)
    if first > 1:  # divergence>=1 (K 0) is refused: it holds for any row
        assert Criterion.parse(f"divergence>={first}", 32).passes(high)
    assert Criterion.parse(f"agreement>={high.agreement}", 32).passes(high)
    assert Criterion.parse("perplexity<0.5", 32).passes(high)


def test_a_decoder_given_in_training_mode_is_run_in_eval_mode_and_the_report_says_so():
    # as check says it: its dropout was off in every run, and the model keeps its own modes
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 100))
    report = tf32lab.check_generation(model, new_tokens=4, prompts=[[1, 2, 3], [4, 5, 6]], levels=("high",))
    said = [note for note in report.notes if "training mode" in note]
    assert len(said) == 1 and "'1' Dropout" in said[0], report.notes
    assert all(m.training for m in model.modules())
    assert not any("training mode" in note for note in tf32lab.check_generation(
        model.eval(), new_tokens=4, prompts=[[1, 2, 3], [4, 5, 6]], levels=("high",)).notes)


def test_the_conclusion_says_what_to_do_next(trained):
    # a level that passes: how to turn it on; none that passes, float32 meeting the criterion: keep `highest`
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 100))
    report = tf32lab.check_generation(model, new_tokens=4, prompts=[[1, 2, 3], [4, 5, 6]],
                                      criterion="agreement>=0.99")
    assert report.level("high").passed
    said = report.conclusion()
    assert said[0].startswith("TF32 (`high`) passes for generating with Sequential on a100"), said
    assert said[0].endswith('Enable it with `torch.set_float32_matmul_precision("high")` or '
                            '`tf32lab.precision("high")`.'), said
    first = tf32lab.check_generation(trained, new_tokens=32, prompts=_prompts(), levels=("high",)).level("high").first
    assert first is not None
    strict = tf32lab.check_generation(trained, new_tokens=32, prompts=_prompts(), levels=("highest", "high"),
                                      criterion=f"divergence>={first + 1}")
    assert not strict.level("high").passed and strict.criterion.passes(strict.floor)
    said = strict.conclusion()
    assert not any("Enable it" in line for line in said), said
    assert said[-1].startswith("Keep `highest` (PyTorch's default) for generating with"), said


def test_no_forward_inherits_the_emulators_scratch_of_the_last(trained):
    # each step reads a longer sequence: a size-pooled scratch kept from one forward is never taken again, and
    # piled up, step after step, to the pool's cap (the check's peak memory three times native generation's)
    from tf32lab.emulation import emulator

    held: list[int] = []
    hook = trained.register_forward_pre_hook(lambda module, args: held.append(emulator._SCRATCH.bytes))
    try:
        tf32lab.check_generation(trained, new_tokens=6, prompts=_prompts()[:2], levels=("high",))
    finally:
        hook.remove()
    assert len(held) >= 2 * 6  # the float64 row's steps, then the emulated row's
    assert max(held) == 0, held
    assert emulator._SCRATCH.bytes == 0  # nor does the caller inherit the last row's


def _gpt2(folder: Path) -> Path:
    """A tiny GPT-2 folder (random weights, scaled so that logits are far from ties) and a byte-level BPE
    tokenizer without a pad token, as GPT-2's ships."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(list(samples.SENTENCES), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(fast), n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                           initializer_range=0.3, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def gpt2_folder(tmp_path_factory) -> Path:
    return _gpt2(tmp_path_factory.mktemp("gpt2"))


def test_the_kv_cache_on_or_off_gives_the_same_answer(gpt2_folder):
    from tf32lab.workloads import hf

    lm = hf.causal_lm(str(gpt2_folder))
    assert lm.tokenizer.pad_token is not None  # set by causal_lm: GPT-2's tokenizer ships without one
    prompts = [s[:24] for s in samples.SENTENCES[:3]]
    on = tf32lab.check_generation(lm, new_tokens=6, prompts=prompts, levels=("high",), use_cache=True)
    off = tf32lab.check_generation(lm, new_tokens=6, prompts=prompts, levels=("high",), use_cache=False)
    assert on.reference_tokens == off.reference_tokens
    for a, b in ((on.level("high"), off.level("high")), (on.floor, off.floor)):
        assert a.divergence == b.divergence and a.agreement == b.agreement
        assert a.loss == pytest.approx(b.loss, rel=1e-6)
    assert on.use_cache and not off.use_cache
    assert on.level("high").unhandled == {}  # every matmul-family op of GPT-2's decoding emulated


def test_the_json_follows_its_schema_and_the_page_its_chart(trained, tmp_path):
    report = tf32lab.check_generation(trained, new_tokens=8, prompts=_prompts()[:4], levels=("highest", "high",
                                                                                              "medium"))
    data = json.loads(report.to_json())
    jsonschema.validate(data, generation_schema())
    assert data["kind"] == "generation" and len(data["levels"]) == 3
    assert data["levels"][2]["same_as"] == "high"  # a100 computes medium as high: run once
    page = report.to_html()
    assert page.count('class="prompt-line"') == 4 and "<script" not in page
    loose = tf32lab.check_generation(trained, new_tokens=4, prompts=_prompts()[:2], levels=("high",),
                                     criterion="perplexity<0.5")
    assert loose.passed and "moves by less than 50%" in " ".join(loose.conclusion())


@pytest.mark.parametrize("kwargs, said", [
    ({"new_tokens": 0}, "new_tokens 0"),
    ({"new_tokens": 2.5}, "new_tokens 2.5"),
    ({"temperature": 0.7}, "temperature 0.7"),
    ({"criterion": "divergence>99"}, r"divergence>K takes K from 1 to 4 with 4 new tokens"),
    ({"criterion": "tokens>3"}, "not understood"),
    ({"prompts": []}, "non-empty list"),
    ({"prompts": [[]]}, "has no tokens"),
    ({"prompts": ["text"]}, "no tokenizer"),
])
def test_bad_arguments_are_one_line_and_leave_flags(trained, kwargs, said):
    args = {"new_tokens": 4, "prompts": [[1, 2]], **kwargs}
    with pytest.raises(Tf32LabError, match=said) as info:
        tf32lab.check_generation(trained, levels=("high",), **args)
    assert "\n" not in str(info.value)
    assert tf32lab.get_float32_matmul_precision() == "highest"


def test_a_model_that_does_not_give_logits_is_refused():
    with pytest.raises(Tf32LabError, match="not a causal language model"):
        flat = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(1))  # [batch, seq * 4]
        tf32lab.check_generation(flat, new_tokens=2, prompts=[[1, 2]], levels=("high",))


def test_a_row_that_raises_is_a_finding(trained):
    class Breaks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = trained

        def forward(self, ids):
            if tf32lab.get_float32_matmul_precision() == "high":
                raise RuntimeError("no TF32 here")
            return self.inner(ids)

    report = tf32lab.check_generation(Breaks(), new_tokens=3, prompts=[_ids("The ")], levels=("high",))
    row = report.level("high")
    assert not row.passed and "no TF32 here" in row.failure and "raised" in report.verdicts()[0]


def _cli(*args: str) -> subprocess.CompletedProcess:
    # a run of an hf: folder forks from a server that has imported transformers, as the run imports it
    return cli_runner.run("check", *args, timeout=300, preload=cli_runner.HF if args[0].startswith("hf:") else ())


def test_cli_generate_writes_each_levels_divergence_and_agreement(gpt2_folder, tmp_path):
    out = tmp_path / "r.json"
    done = _cli(f"hf:{gpt2_folder}", "--generate", "8", "--levels", "high", "--json", str(out),
                "--criterion", "agreement>=0")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    data = json.loads(out.read_text())
    jsonschema.validate(data, generation_schema())
    for row in data["levels"]:
        assert len(row["divergence"]) == len(data["prompts"]) == 8
        assert 0 <= row["agreement"] <= 1
    # the default prompts start 8 different texts: no subject, and no ending, twice
    subjects = {" ".join(p.split()[:2]) for p in data["prompts"]}
    endings = {" ".join(p.split()[-3:]) for p in data["prompts"]}
    assert len(subjects) == len(endings) == 8, data["prompts"]
    assert "PASSED | level 'high' | generation 8 tokens x 8 prompts" in done.stdout


@pytest.mark.parametrize("args, said", [
    (["--generate", "0"], "bad number of new tokens '0'"),
    (["--generate", "-3"], "bad number of new tokens '-3'"),
    (["--generate", "2.5"], "bad number of new tokens '2.5'"),
    (["--generate", "4", "--prompts", "/no/such/prompts.txt"], "no such file"),
    (["--generate", "4", "--prompts", "EMPTY"], "holds no prompt"),
    # an empty path is the working folder to Path(): named as given; a folder is said so, not as an errno
    (["--generate", "4", "--prompts", ""], "--prompts '': no path given (a text file, one prompt per line)"),
    (["--generate", "4", "--prompts", "/"], "--prompts /: is a folder (a text file, one prompt per line)"),
    (["--generate", "4", "--criterion", "speed>2"], "not understood"),
    (["--prompts", "EMPTY"], "goes with --generate"),
])
def test_cli_bad_generation_input_is_one_line_exit_2(gpt2_folder, tmp_path, args, said):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    done = _cli(f"hf:{gpt2_folder}", *[str(empty) if a == "EMPTY" else a for a in args])
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2  # argparse's usage line, then the one error line


def test_cli_generate_refuses_a_spec_that_is_not_a_causal_lm():
    done = _cli("builtin", "--generate", "4")
    assert done.returncode == 2 and "hf:FOLDER" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_prompt_file_prompts_reach_the_report(gpt2_folder, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The river ferry\n\nA small bakery sells\n")
    out = tmp_path / "r.json"
    done = _cli(f"hf:{gpt2_folder}", "--generate", "3", "--levels", "high", "--prompts", str(prompts),
                "--json", str(out), "--no-cache")
    assert done.returncode in (0, 1), done.stderr
    data = json.loads(out.read_text())
    assert data["prompts"] == ["The river ferry", "A small bakery sells"] and data["use_cache"] is False
    assert not math.isnan(float(data["reference"]["loss"]))


def _printed(report, width: int) -> list[str]:
    from rich.console import Console

    out = io.StringIO()
    report.print(Console(file=out, width=width, color_system=None, highlight=False))
    return out.getvalue().splitlines()


@pytest.mark.parametrize("target", ["a100", "cpu-amx", "v100"])  # medium computed as high; medium a row of its own
def test_the_text_tables_fit_80_columns_one_line_a_row(trained, target):
    from tf32lab.report.generation_render import short

    prompts = list(samples.SENTENCES[::9])  # long ones: each is cut to the prompt column
    report = tf32lab.check_generation(_with_text(trained), new_tokens=4, prompts=prompts, target=target,
                                      levels=("highest", "high", "medium"))
    lines = _printed(report, 80)
    verdicts, said = report.verdicts(), report.conclusion()
    tables = lines[:lines.index(verdicts[0])]  # the tables, then the verdicts, then the conclusion
    assert max(map(len, lines[lines.index(verdicts[-1]) + 1:])) <= 80  # the conclusion wrapped
    assert max(map(len, tables)) <= 80, "\n".join(tables)
    for lv in [report.floor, *report.levels]:  # every row on one line: its name, its numbers, its verdict
        label = lv.level + (f"={lv.same_as}" if lv.same_as else "")
        assert any(re.match(rf"{re.escape(label)} .*\b(floor|PASSED|FAILED)\b", line) for line in tables), \
            "\n".join(tables)
    assert not any(line.strip().startswith("(") for line in tables), "\n".join(tables)  # no label's tail alone
    for prompt in prompts:  # each prompt whole on its line, beside its steps
        assert any(short(prompt) in line and re.search(r"(none|\d+)\s*\S?$", line) for line in tables)
    assert all(line in lines for line in verdicts)  # verdicts unwrapped: they grep
    assert " ".join(said) in " ".join(" ".join(lines).split())  # and the whole conclusion said


HOSTILE = """<script>alert("x")</script> & 'q'"""
CHART = """() => {
  const box = e => { const r = e.getBoundingClientRect(); return {x: r.x, y: r.y, w: r.width, h: r.height}; };
  const svg = document.querySelector('svg.divergence');
  if (!svg) return null;
  return {
    svg: box(svg), scripts: document.scripts.length,
    heading: document.querySelector('h1').innerText,
    ticks: [...svg.querySelectorAll(':scope > text')].map(t => ({label: t.textContent, box: box(t)})),
    lines: [...svg.querySelectorAll('g.prompt-line')].map(g => ({
      label: g.querySelector('text').textContent, label_box: box(g.querySelector('text')),
      axis: box(g.querySelector('line')),
      marks: [...g.querySelectorAll('circle')].map(c => ({box: box(c), title: c.textContent.trim(),
                                                         fill: getComputedStyle(c).fill}))})),
  };
}"""


def test_the_generation_page_draws_each_prompts_divergence_in_chromium(trained, tmp_path):
    from browser import visit
    from tf32lab.report.generation_render import short

    n = 32  # as in the test above: some tail leaves float64's tokens at high within 32 on any CPU's weights
    prompts = [*_tails(), HOSTILE]
    report = tf32lab.check_generation(_with_text(trained), new_tokens=n, prompts=prompts,
                                      levels=("highest", "high", "medium"))
    high, floor = report.level("high"), report.floor
    assert high.first is not None  # the chart has a row that leaves float64's tokens to draw
    page = tmp_path / "generation.html"
    page.write_text(report.to_html(), encoding="utf-8")
    seen = visit(page, tmp_path / "generation.png", measure=CHART)
    assert seen.console_errors == [] and seen.dialogs == [] and seen.requests == []
    chart = seen.measured
    assert chart is not None, "no divergence chart on the page"
    # the prompt is text on the page, never markup that runs
    assert chart["scripts"] == 0 and HOSTILE in seen.text
    assert "<script>alert" not in page.read_text(encoding="utf-8")
    # the levels, the verdict and the verdict lines as a reader sees them
    assert chart["heading"].endswith("PASSED" if report.passed else "FAILED")
    for row in ("float32", "highest", "high", "medium (= high)"):
        assert re.search(rf"^{re.escape(row)}\s", seen.text, re.M), row
    assert all(line in seen.text for line in report.verdicts())
    # the chart: inside the window, one line per prompt, labels left of the plot and one under another
    svg = chart["svg"]
    assert svg["w"] >= 400 and svg["x"] >= 0 and svg["x"] + svg["w"] <= 1200
    assert svg["h"] >= 20 * len(prompts)
    lines = chart["lines"]
    assert [line["label"] for line in lines] == [short(p) for p in prompts]
    for line, below in zip(lines, lines[1:]):
        assert line["label_box"]["y"] + line["label_box"]["h"] <= below["label_box"]["y"] + 1
    ticks = {t["label"]: t["box"]["x"] + t["box"]["w"] / 2 for t in chart["ticks"]}
    x1, xn = ticks["step 1"], ticks[f"step {n}"]
    assert xn - x1 >= 200

    def x_of(step: int) -> float:
        return x1 + (xn - x1) * (step - 1) / (n - 1)

    for i, line in enumerate(lines):
        label, axis = line["label_box"], line["axis"]
        assert label["w"] > 20 and label["x"] >= svg["x"] and label["x"] + label["w"] <= axis["x"]
        assert abs(axis["x"] - x1) <= 1 and abs(axis["x"] + axis["w"] - xn) <= 1
        marks = {m["title"].split(":")[0]: m for m in line["marks"]}
        assert set(marks) == {"float32", "high"}  # medium is high's row: drawn once
        for name, row in (("float32", floor), ("high", high)):
            mark, step = marks[name], row.divergence[i]
            box = mark["box"]
            cx, cy = box["x"] + box["w"] / 2, box["y"] + box["h"] / 2
            assert 6 <= box["w"] <= 12 and 6 <= box["h"] <= 12  # a dot, drawn
            assert box["x"] >= svg["x"] and box["x"] + box["w"] <= svg["x"] + svg["w"]
            assert abs(cy - (axis["y"] + axis["h"] / 2)) <= 8  # on its prompt's line
            if step is None:  # past the last step, open
                assert cx > xn + 5 and mark["fill"] == "none" and "never" in mark["title"]
            else:
                assert abs(cx - x_of(step)) <= 1.5 and mark["fill"] != "none"
                assert f"step {step}" in mark["title"]


class Lines(Chars):
    """The trained decoder's tokenizer, its end of text the newline: the sample text holds one sentence a line."""

    eos_token_id = CHARS.index("\n")


def test_tokens_after_float64s_end_of_text_are_not_compared(trained):
    # generate() stops at the end-of-text token: what a model writes after it is no text a user sees. Decoding
    # went on, and `high` was said to leave float64's tokens in the next sentence, after an end both had written
    texts = [Chars().decode(p) for p in _prompts()]
    plain = tf32lab.check_generation(_with_text(trained), new_tokens=32, prompts=texts, levels=("high",))
    lines = tf32lab.check_generation(CausalLM(trained, Lines(), "lines"), new_tokens=32, prompts=texts,
                                     levels=("high",))
    assert lines.reference_tokens == plain.reference_tokens  # the same tokens decoded; only what is compared
    nl = Lines.eos_token_id
    ends = tuple(t.index(nl) + 1 if nl in t else 32 for t in lines.reference_tokens)
    assert lines.reference_ends == ends and min(ends) < 32
    was, now = plain.level("high").divergence, lines.level("high").divergence
    assert now == tuple(None if step is None or step > end else step for step, end in zip(was, ends))
    assert any(step is not None and step > end for step, end in zip(was, ends))  # the finding, ended
    assert any("end-of-text token" in note for note in lines.notes)
    # the logits' error too, step by step: the largest over the prompts whose text goes on there (over all of
    # them, a step after every prompt's end gave the error of logits no user sees)
    mine, every = lines.level("high").logit_errors, plain.level("high").logit_errors
    assert mine[:min(ends)] == every[:min(ends)]
    assert all(a <= b for a, b in zip(mine, every)) and all(e == 0.0 for e in mine[max(ends):])
    assert mine != every
    data = json.loads(lines.to_json())
    jsonschema.validate(data, generation_schema())
    assert data["reference"]["ends"] == list(ends)


def test_a_model_that_rescales_its_weights_once_decodes_from_its_weights_at_every_row():
    # RWKV's eval mode: at its first call it divides a weight in place and marks itself; the mark was put back
    # before every row and the weight was not, so every row divided it again: `highest` left float64's tokens at
    # step 1 (logits off by 1.1) and the model was left divided and unmarked
    class Rescales(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50)
            self.rescaled = False

        def forward(self, ids):
            if not self.training and not self.rescaled:
                with torch.no_grad():
                    self.head.weight.mul_(4.0)
                self.rescaled = True
            return self.head(torch.tanh(self.embed(ids)))

    torch.manual_seed(0)
    model = Rescales().eval()
    weight = model.head.weight.detach().clone()
    report = tf32lab.check_generation(model, new_tokens=8, prompts=[[1, 2, 3], [4, 5, 6]], levels=("highest",))
    assert report.level("highest").divergence == (None, None) and max(report.level("highest").logit_errors) < 1e-4
    assert not model.rescaled and torch.equal(model.head.weight, weight)
