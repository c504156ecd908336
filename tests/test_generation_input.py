"""The generation check on what a hostile user hands it: criteria in forms the docs do not list, a vocabulary
masked to -inf, token ids that are not whole numbers, prompts from a generator, a prompt file from a Windows editor,
and flags that take an empty value. Plain-torch decoders made here, each a few milliseconds a step."""

from __future__ import annotations

import dataclasses
import json
import math

import jsonschema
import pytest
import torch

import cli_runner
import tf32lab
from tf32lab.errors import Tf32LabError
from tf32lab.report.generation import Criterion, generation_schema, median_divergence


class Masked(torch.nn.Module):
    """A decoder whose last ``masked`` vocabulary entries are never allowed: their logits are -inf, as a
    vocabulary padded to a multiple of 64 or a constrained decoder masks them."""

    def __init__(self, vocab: int = 50, masked: int = 10) -> None:
        super().__init__()
        self.masked = masked
        self.embed = torch.nn.Embedding(vocab, 32)
        self.out = torch.nn.Linear(32, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.out(torch.tanh(self.embed(ids)) * 3)
        return torch.cat([logits[..., :-self.masked], torch.full_like(logits[..., -self.masked:], -math.inf)], -1)


@pytest.fixture
def masked() -> Masked:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Masked()


def test_a_median_is_a_step_some_prompt_took_or_none():
    # a prompt that never leaves float64's tokens was counted as step new_tokens + 1 and averaged: steps 2 and
    # none gave 6 at 8 new tokens and 18 at 32, a step neither prompt took
    assert median_divergence((2, None), 8) is None and median_divergence((2, None), 32) is None
    assert median_divergence((2, 4, None), 32) == 4.0 and median_divergence((2, 4), 32) == 3.0
    assert median_divergence((2, None, None), 32) is None and median_divergence((5, 2, 9), 9) == 5.0


@pytest.mark.parametrize("text", ["agreement>0.9", "agreement>1", "perplexity<=0.01"])
def test_a_criterion_the_docs_do_not_list_is_refused_not_read_as_another(text):
    # agreement>1 was read as agreement>=1 and passed a row of full agreement; perplexity<= as <
    with pytest.raises(Tf32LabError, match=r"takes (>=|<) and") as raised:
        Criterion.parse(text, new_tokens=8)
    assert "\n" not in str(raised.value)


def test_a_vocabulary_masked_to_minus_inf_has_finite_logit_errors(masked):
    report = tf32lab.check_generation(masked, new_tokens=4, prompts=[[1, 2, 3], [4, 5, 6]], levels=("high",))
    for row in (report.floor, report.level("high")):
        # -inf - -inf is nan: every step's error was nan, and the JSON said "nan" where the rows agree exactly
        assert all(math.isfinite(e) for e in row.logit_errors), row.logit_errors
        assert 0 < row.worst_logit_error < 0.1
    data = json.loads(report.to_json())
    jsonschema.validate(data, generation_schema())
    assert "nan" not in data["levels"][0]["logit_errors"]


@pytest.mark.parametrize("text, said", [
    ("divergence>=0", r"divergence>=K takes K from 2 to 9 with 8 new tokens$"),  # named a K of -1
    ("divergence>9", r"divergence>K takes K from 1 to 8 with 8 new tokens$"),
    # K 0 passed every row that ran, however early its tokens left float64's
    ("divergence>0", r"divergence>K takes K from 1 to 8 with 8 new tokens \(divergence>0 holds for any row"),
    # named by the K given: 'K 0' beside 'divergence>=K takes K from 2' read as if 0 had been given
    ("divergence>=1", r"divergence>=K takes K from 2 to 9 with 8 new tokens \(divergence>=1 holds for any row"),
    ("divergence >= 1", r"new tokens \(divergence>=1 holds for any row"),
])
def test_a_divergence_out_of_range_names_the_range_in_the_form_given(text, said):
    with pytest.raises(Tf32LabError, match=said):
        Criterion.parse(text, new_tokens=8)


@pytest.mark.parametrize("prompt, said", [
    ([3, -1], r"prompt 2 \('3 -1'\) has token id -1; model 'Masked' takes ids 0 or more"),
])
def test_a_negative_token_id_names_its_prompt(masked, prompt, said):
    with pytest.raises(Tf32LabError, match=said):  # "index out of range in self" at the float64 reference
        tf32lab.check_generation(masked, new_tokens=2, prompts=[[1, 2], prompt], levels=("high",))


def test_a_numpy_count_of_new_tokens_is_taken(masked):
    numpy = pytest.importorskip("numpy")
    report = tf32lab.check_generation(masked, new_tokens=numpy.int64(3), prompts=[[1, 2]], levels=("highest",))
    assert report.new_tokens == 3 and type(report.new_tokens) is int  # "new_tokens 3: a whole number" before


def test_token_ids_that_are_not_whole_numbers_are_refused(masked):
    with pytest.raises(Tf32LabError, match=r"prompt 1 \(\[1\.7, 2\]\): a text or a list of token ids \(whole "
                                           r"numbers\)"):
        tf32lab.check_generation(masked, new_tokens=2, prompts=[[1.7, 2]], levels=("high",))  # was read as [1, 2]


def test_prompts_from_a_generator_are_taken(masked):
    report = tf32lab.check_generation(masked, new_tokens=2, prompts=([i, i + 1] for i in range(3)),
                                      levels=("highest",))  # len() of a generator raised TypeError
    assert len(report.prompts) == 3 and report.prompts[2] == "2 3"


def test_a_perplexity_criterion_with_no_prompt_of_two_tokens_is_refused(masked):
    # no loss on the prompts' own text: every row failed, and float32 was said to ask for a looser criterion
    with pytest.raises(Tf32LabError, match=r"criterion 'perplexity<0.1' judges the loss on the prompts' own text, "
                                           r"and no prompt has two tokens or more"):
        tf32lab.check_generation(masked, new_tokens=2, prompts=[[1], [2]], levels=("high",),
                                 criterion="perplexity<0.1")
    assert tf32lab.get_float32_matmul_precision() == "highest"


def test_a_prompt_file_from_a_windows_editor_reads_as_written(tmp_path):
    from tf32lab.cli import _prompt_file

    path = tmp_path / "prompts.txt"
    # a byte-order mark was kept as the first prompt's first character; a form feed split a line in two
    path.write_bytes("\ufeffThe river ferry\r\n\r\nA page\x0cbreak inside\r\n  \rLast\n".encode())
    assert _prompt_file(str(path)) == ["The river ferry", "A page\x0cbreak inside", "Last"]


@pytest.mark.parametrize("flag", ["--criterion", "--prompts"])
def test_an_empty_generation_flag_without_generate_is_one_line_exit_2(flag):
    done = cli_runner.run("check", "builtin", flag, "", timeout=120)  # a StopIteration traceback, exit 1
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"{flag} goes with --generate N" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_token_id_past_a_transformers_models_embedding_names_its_prompt():
    transformers = pytest.importorskip("transformers")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                                                     n_positions=32))
    with pytest.raises(Tf32LabError, match=r"prompt 2 \('4 50'\) has token id 50; model 'GPT2LMHeadModel' takes "
                                           r"ids 0 to 49, its input embeddings"):
        tf32lab.check_generation(gpt2, new_tokens=2, prompts=[[1, 2], [4, 50]], levels=("high",))


def test_a_criterion_and_a_share_are_never_shown_rounded_to_what_they_are_not(masked):
    # agreement>=0.9999 read "at least 100.0%", and a row of 99.995% showed 100.0% beside FAILED: one decimal of a
    # percent said what neither was
    assert Criterion.parse("agreement>=0.9999", 8).words().endswith("at least 99.99%")
    assert Criterion.parse("agreement>=0.95", 8).words().endswith("at least 95%")
    # at six digits, agreement>=0.9999999 read "at least 100%" and perplexity<0.0123456 "less than 1.235%"
    assert Criterion.parse("agreement>=0.9999999", 8).words().endswith("at least 99.99999%")
    assert Criterion.parse("agreement>=0.57", 8).words().endswith("at least 57%")
    assert Criterion.parse("perplexity<0.0123456", 8).words().endswith("less than 1.23456%")
    assert Criterion.parse("agreement>=-0", 8).text == "agreement>=0"
    report = tf32lab.check_generation(masked, new_tokens=2, prompts=[[1, 2, 3]], levels=("high",),
                                      criterion="agreement>=0.99999")
    row = dataclasses.replace(report.level("high"), agreement=0.99995, passed=False)
    report = dataclasses.replace(report, levels=(row,))
    (verdict,), first = report.verdicts(), report.conclusion()[0]
    assert "agreement 99.995%;" in verdict and "FAILED" in verdict
    assert "on 99.995% of teacher-forced steps" in first and "at least 99.999%" in first
    assert ">99.995%</td>" in report.to_html()


def test_bytes_and_text_a_tokenizer_cannot_take_are_one_line_naming_the_prompt():
    import hf_builders
    from tf32lab.workloads.hf import CausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        lm = CausalLM(Masked(vocab=hf_builders.VOCAB), hf_builders.tokenizer(eos_token="</s>"), "masked")
    # bytes were read as token ids (b"hi" as [104, 105]): a text read in binary is not a list of ids
    with pytest.raises(Tf32LabError, match=r"^prompt 2 \(b'hi'\) is bytes: give text \(decoded\) or a list of "
                                           r"token ids$"):
        tf32lab.check_generation(lm, new_tokens=2, prompts=["The cat", b"hi"], levels=("high",))
    # a lone surrogate (a file name's undecodable byte) raised the tokenizer's TypeError
    with pytest.raises(Tf32LabError, match=r"^prompt 1 \('\\ud800 hi'\): the tokenizer cannot take it \("):
        tf32lab.check_generation(lm, new_tokens=2, prompts=["\ud800 hi"], levels=("high",))
    assert tf32lab.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize("ids, said", [([-5, 3], "-5"), ([2 ** 70], str(2 ** 70)), ([10 ** 6], str(10 ** 6))])
def test_a_token_id_out_of_range_with_a_tokenizer_names_its_prompt_by_its_ids(ids, said):
    import hf_builders
    from tf32lab.workloads.hf import CausalLM

    class Embedded(Masked):  # says its vocabulary, as a transformers model does
        def get_input_embeddings(self) -> torch.nn.Embedding:
            return self.embed

    with torch.random.fork_rng():
        torch.manual_seed(0)
        lm = CausalLM(Embedded(vocab=hf_builders.VOCAB), hf_builders.tokenizer(eos_token="</s>"), "masked")
    # the tokenizer's decode() of the prompt, to show it, raised OverflowError before the range was checked (and
    # an id past the vocabulary was shown as the prompt '')
    shown = " ".join(map(str, ids))
    with pytest.raises(Tf32LabError, match=rf"^prompt 2 \('{shown}'\) has token id {said}; model 'masked' takes "
                                           rf"ids 0 to 299, its input embeddings$"):
        tf32lab.check_generation(lm, new_tokens=2, prompts=[[1, 2], ids], levels=("high",))


def test_a_criterion_of_one_token_reads_as_one():
    # "within the first 1 new tokens"
    assert Criterion.parse("divergence>=2", 8).words() == "no prompt leaves float64's tokens at the first new token"
    assert Criterion.parse("divergence>2", 8).words().endswith("within the first 2 new tokens")


def test_a_prompt_file_keeps_each_lines_spaces(tmp_path):
    from tf32lab.cli import _prompt_file

    path = tmp_path / "code.txt"
    path.write_text("def f(x):\n    return x  \n\n   \n")  # stripped, the second prompt lost its indentation
    assert _prompt_file(str(path)) == ["def f(x):", "    return x  "]


@pytest.mark.parametrize("value", ["no", 0.0, None])
def test_use_cache_takes_true_or_false_only(masked, value):
    with pytest.raises(Tf32LabError, match=r"use_cache .*: True or False"):  # bool("no") decoded with the cache
        tf32lab.check_generation(masked, new_tokens=2, prompts=[[1, 2]], levels=("high",), use_cache=value)


def test_one_prompt_reads_as_one(masked):
    report = tf32lab.check_generation(masked, new_tokens=2, prompts=[[1, 2]], levels=("high",))
    (verdict,) = report.verdicts()
    assert "tokens x 1 prompt |" in verdict  # "x 1 prompts"


def test_use_cache_takes_numpys_bools(masked):
    """A NumPy bool is a bool here, as a NumPy integer is a number of new tokens: NumPy 2 names its type ``bool``
    (``bool_`` in NumPy 1), and ``np.True_`` was refused as neither True nor False."""
    import numpy as np

    report = tf32lab.check_generation(masked, new_tokens=2, prompts=[[1, 2]], levels=("high",), use_cache=np.True_)
    assert report.levels


class RecurrentDecoder(torch.nn.Module):
    """An LSTM language model: ids [batch, seq] -> logits, every step run over the whole sequence."""

    def __init__(self, vocab: int = 40) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 16)
        self.lstm = torch.nn.LSTM(16, 64, batch_first=True)
        self.out = torch.nn.Linear(64, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(self.embed(ids))[0])


def test_the_floor_of_an_lstm_decoder_runs_at_cudnns_rnn_math_not_natively():
    """An emulated LSTM's GEMMs are counted as ``aten::linear``: the rows seemed to meet the matmul family only,
    IEEE at `highest` on an A100, so the floor ran natively, the LSTM in IEEE float32 where cuDNN's RNN flag (TF32
    by default) makes an A100 run it in TF32 at `highest`."""
    torch.manual_seed(0)
    report = tf32lab.check_generation(RecurrentDecoder(), new_tokens=3, prompts=[[1, 2, 3, 4]],
                                      levels=("highest", "high"))
    assert report.floor.coverage, report.floor


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_an_encoder_decoder_is_refused_in_one_line_before_any_forward(kind):
    # T5 raised "You must specify exactly one of input_ids or inputs_embeds" in float64, BART a shape error at its
    # second step: the prompt went to the encoder and no decoder input was given, said as if the model were broken
    transformers = pytest.importorskip("transformers")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=50, d_model=16, d_ff=32, d_kv=4, num_layers=1, num_heads=4, decoder_start_token_id=0)) \
            if kind == "t5" else transformers.BartForConditionalGeneration(transformers.BartConfig(
                vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32))
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    name = type(model).__name__
    with pytest.raises(Tf32LabError, match=rf"^model {name!r} is an encoder-decoder \(model type {kind!r}\); the "
                                           rf"generation check decodes a decoder-only causal language model"):
        tf32lab.check_generation(model, new_tokens=2, prompts=[[1, 2, 3], [4, 5]], levels=("high",))
    assert calls == []



def test_a_numpy_prompt_is_read_as_a_tensor_is(masked):
    # a 1-D NumPy array was read as a list of prompts, each id one: "prompt 1 (np.int64(1)): a text or a list of
    # token ids"; a 1-D tensor was one prompt
    numpy = pytest.importorskip("numpy")
    ids = [[1, 2, 3], [4, 5, 6]]
    expected = tf32lab.check_generation(masked, new_tokens=2, prompts=[torch.tensor(ids[0])], levels=("highest",))
    one = tf32lab.check_generation(masked, new_tokens=2, prompts=numpy.array(ids[0]), levels=("highest",))
    assert one.prompts == expected.prompts == ("1 2 3",)
    both = tf32lab.check_generation(masked, new_tokens=2, prompts=numpy.array(ids), levels=("highest",))
    assert both.prompts == ("1 2 3", "4 5 6")
    rows = tf32lab.check_generation(masked, new_tokens=2, prompts=[numpy.array(i) for i in ids], levels=("highest",))
    assert rows.prompts == both.prompts and rows.reference_tokens == both.reference_tokens
    with pytest.raises(Tf32LabError, match=r"is bytes: give text"):
        tf32lab.check_generation(masked, new_tokens=2, prompts=[memoryview(b"hi")], levels=("highest",))
