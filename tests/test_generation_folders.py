"""The generation check on ``hf:`` folders as users keep them: prompts tokenized as ``model.generate(**tokenizer(
prompt))`` sees them (a Llama tokenizer's beginning-of-text token), prompts past the position table refused before
any forward, and a generation config whose settings the check does not apply said. Two-layer folders, 32 wide."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

import cli_runner
import hf_builders
import tf32lab
from tf32lab import cli
from tf32lab.errors import Tf32LabError
from tf32lab.workloads import hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("hf_cli")  # with test_hf_folders.py: one server that imported transformers

_POSITIONS = 32  # a short table: a prompt past it is a few dozen tokens


def _bos_tokenizer() -> object:
    """A tokenizer that adds its beginning-of-text token to every text, as Llama's do (tokenizer.json's template)."""
    from tokenizers import processors

    tok = hf_builders.tokenizer(bos_token="<s>", eos_token="</s>")
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tok


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama_bos")
    return hf_builders.folder(path, hf_builders.llama(max_position_embeddings=_POSITIONS, tie_word_embeddings=True),
                              _bos_tokenizer())


@pytest.fixture(scope="session")
def gpt2_folder(tmp_path_factory) -> Path:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=hf_builders.VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=_POSITIONS))
    return hf_builders.folder(tmp_path_factory.mktemp("gpt2"), model,
                              hf_builders.tokenizer(eos_token="<|endoftext|>"))


def _forwards(model: torch.nn.Module) -> list[int]:
    """A list that grows by one at each forward of ``model``."""
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_prompt_past_the_position_table_is_refused_before_any_forward(kind, llama_folder, gpt2_folder):
    # a rotary decoder (Llama) ran on past its table, the float64 row taking memory with the length (7.6 GB for
    # a 15k-token prompt on a two-layer Llama), and an absolute one (GPT-2) raised in float64 before it was said
    lm = hf.causal_lm(str(llama_folder if kind == "llama" else gpt2_folder))
    calls = _forwards(lm.model)
    field = "max_position_embeddings" if kind == "llama" else "n_positions"
    with pytest.raises(Tf32LabError, match=rf"^prompt 2 \(30 tokens, the longest\) and 4 new tokens need 33 "
                                           rf"positions; model '\w+' has 32 \(config.{field}\): give at most 3 "
                                           rf"new tokens, or shorter prompts$"):
        tf32lab.check_generation(lm, new_tokens=4, prompts=[[5, 6], [7] * 30], levels=("high",))
    assert not calls
    assert tf32lab.get_float32_matmul_precision() == "highest"


def test_a_prompt_and_new_tokens_that_fill_the_table_exactly_run(gpt2_folder):
    # the last new token is never fed: 29 + 4 tokens use 32 positions, GPT-2's whole table
    lm = hf.causal_lm(str(gpt2_folder))
    report = tf32lab.check_generation(lm, new_tokens=4, prompts=[[7] * 29], levels=("highest",))
    assert len(report.reference_tokens[0]) == 4


def test_a_scaled_rotary_table_reaches_its_factor_and_a_dynamic_one_has_no_limit():
    from tf32lab.measure.generation import _positions

    yarn = transformers.LlamaConfig(max_position_embeddings=32, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    assert _positions(yarn) == (128, "32 x 4, its yarn rotary scaling")
    dynamic = transformers.LlamaConfig(max_position_embeddings=32, rope_scaling={"rope_type": "dynamic",
                                                                                  "factor": 2.0})
    assert _positions(dynamic) is None
    assert _positions(transformers.LlamaConfig(max_position_embeddings=32)) == (32, "config.max_position_embeddings")


def test_a_dynamic_rotary_scaling_past_its_table_agrees_with_float64_on_the_same_input(tmp_path):
    # NTK-aware scaling rescales by the length it is given: past the table a cached step and the whole sequence
    # give other logits, and float32 (never leaving float64's tokens) read 74% agreement against float64's cached
    # tokens, failing agreement>=0.9 on its own
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = hf_builders.llama(max_position_embeddings=16, initializer_range=0.3,
                                  rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    folder = hf_builders.folder(tmp_path / "dynamic", model, _bos_tokenizer())
    report = tf32lab.check_generation(hf.causal_lm(str(folder)), new_tokens=20, levels=("highest",),
                                      criterion="agreement>=0.9")
    assert all(step is None for step in report.floor.divergence)
    assert report.floor.agreement == 1.0 and report.passed


def test_cli_a_prompt_file_past_the_table_is_one_line_exit_2(llama_folder, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The cat\n" + " ".join(["river"] * 40) + "\n")
    done = cli_runner.run("check", f"hf:{llama_folder}", "--generate", "8", "--prompts", str(prompts),
                          "--levels", "high", timeout=300, preload=cli_runner.HF)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1 and "prompt 2 (" in line and "8 new tokens" in line and "has 32" in line


def _prompt_ids(lm, prompts: list[str]) -> list[list[int]]:
    """The token ids of each prompt at the model's first forward (the float64 row's), padding left out."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(module, args, kwargs):
        if not seen:
            seen.append((kwargs["input_ids"].clone(), kwargs["attention_mask"].clone()))

    handle = lm.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        tf32lab.check_generation(lm, new_tokens=2, prompts=prompts, levels=("highest",))
    finally:
        handle.remove()
    ids, mask = seen[0]
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_prompts_are_tokenized_as_generate_sees_them(kind, llama_folder, gpt2_folder):
    # a Llama tokenizer adds its beginning-of-text token to what a user feeds generate(); the check left it out,
    # so every row decoded from a text the model is never given
    lm = hf.causal_lm(str(llama_folder if kind == "llama" else gpt2_folder))
    prompts = ["The river ferry", "A tired engineer was late again"]
    users = [lm.tokenizer(p)["input_ids"] for p in prompts]
    assert (users[0][0] == lm.tokenizer.bos_token_id) == (kind == "llama")  # the folders are what they say
    assert _prompt_ids(lm, prompts) == users


def test_the_loss_on_a_prompt_is_the_one_a_user_computes(llama_folder):
    # a one-word prompt after the beginning-of-text token has a loss of its own (the word given the start); the
    # check had none and said "no prompt has two tokens or more"
    lm = hf.causal_lm(str(llama_folder))
    report = tf32lab.check_generation(lm, new_tokens=2, prompts=["The", "River"], levels=("highest",))
    wide = transformers.LlamaForCausalLM.from_pretrained(str(llama_folder)).double().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt in ("The", "River"):  # transformers' loss is a prompt's mean: the check's is every token's
            ids = lm.tokenizer(prompt, return_tensors="pt")["input_ids"]
            total += float(wide(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    # transformers takes the loss of logits cast to float32: equal to its rounding
    assert math.isclose(report.reference_loss, total / count, rel_tol=1e-6)


def test_generation_config_settings_the_check_does_not_apply_are_said(llama_folder, tmp_path):
    # a repetition penalty, an n-gram ban or a forced end token in generation_config.json change the tokens
    # generate() writes; the check compared the raw greedy tokens without a word
    folder = tmp_path / "penalised"
    folder.mkdir()
    for item in llama_folder.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "generation_config.json").read_text())
    # a decoder-only model's generate() applies encoder_repetition_penalty to the prompt's tokens too
    config.update(repetition_penalty=1.3, no_repeat_ngram_size=3, eos_token_id=[2, 5], num_beams=1,
                  encoder_repetition_penalty=5.0)
    (folder / "generation_config.json").write_text(json.dumps(config))
    report = tf32lab.check_generation(hf.causal_lm(str(folder)), new_tokens=2,
                                      prompts=["The river"], levels=("highest",))
    said = [note for note in report.notes if "generation config" in note]
    assert len(said) == 1 and "repetition_penalty=1.3, no_repeat_ngram_size=3, encoder_repetition_penalty=5.0, " \
        "which generate() applies" in said[0]
    assert "num_beams" not in said[0]  # one beam is greedy: nothing unapplied
    plain = tf32lab.check_generation(hf.causal_lm(str(llama_folder)), new_tokens=2,
                                     prompts=["The river"], levels=("highest",))
    assert not [note for note in plain.notes if "generation config" in note]


def test_a_generation_config_that_cannot_be_read_is_said(llama_folder, tmp_path):
    # transformers loads the model without it, silently: a do_sample or a penalty in it went unnamed
    folder = tmp_path / "cut"
    folder.mkdir()
    for item in llama_folder.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    (folder / "generation_config.json").write_text('{"do_sample": true, "top_k": 5,')  # a cut-short file
    report = tf32lab.check_generation(hf.causal_lm(str(folder)), new_tokens=2, prompts=["The river"],
                                      levels=("highest",))
    said = [note for note in report.notes if "generation_config.json could not be read" in note]
    assert len(said) == 1 and "neither generate() nor this check applies or names its settings" in said[0]


class _Wide(torch.nn.Module):
    """A decoder of a million-token vocabulary and two dimensions: a few MB of weights, logits of a million
    floats a token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1_000_000, 2)
        self.out = torch.nn.Linear(2, 1_000_000)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


def test_logits_past_the_memory_available_are_refused_before_any_forward():
    # 2 prompts x 100000 new tokens x a million ids: terabytes of float64 logits kept to compare every row with;
    # the float64 row started, and the machine's out-of-memory killer was what ended it
    model = _Wide()
    calls = _forwards(model)
    with pytest.raises(Tf32LabError, match=r"^2 prompts and 100000 new tokens over model '_Wide''s vocabulary of "
                                           r"1000000 need about \d+\.\d GiB for the logits the check compares "
                                           r"\(float64's kept for every row\), more than the [\d.]+ GiB available "
                                           r"on cpu: give fewer new tokens or fewer prompts$"):
        tf32lab.check_generation(model, new_tokens=100_000, prompts=[[1, 2, 3], [4]], levels=("high",))
    assert not calls


def test_an_alibi_falcon_runs_past_its_max_position_embeddings():
    # ALiBi makes its biases for any length: a Falcon with alibi=True has max_position_embeddings but no table
    # (it was refused, valid input); a rotary Falcon keeps the limit
    from tf32lab.measure.generation import _positions

    config = dict(vocab_size=hf_builders.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=8)
    assert _positions(transformers.FalconConfig(**config, alibi=False)) == (8, "config.max_position_embeddings")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.FalconForCausalLM(transformers.FalconConfig(**config, alibi=True)).eval()
    report = tf32lab.check_generation(model, new_tokens=4, prompts=[[5] * 12, [7, 8, 9]], levels=("high",))
    assert [len(tokens) for tokens in report.reference_tokens] == [4, 4]


def test_a_tokenizer_that_appends_its_end_token_gives_prompts_without_it(llama_folder):
    # a tokenizer that ends every text with its end-of-text token (add_eos_token, a BERT tokenizer's [SEP]): each
    # prompt ended there, every row wrote a new text after it, and the prompts' loss took in their end
    from tokenizers import processors

    lm = hf.causal_lm(str(llama_folder))
    tok = lm.tokenizer
    bos, eos = tok.bos_token_id, tok.eos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    prompts = ["The river ferry", "A tired engineer was late again"]
    users = [tok(p)["input_ids"] for p in prompts]
    assert all(ids[0] == bos and ids[-1] == eos for ids in users)  # the tokenizer is what it says
    assert _prompt_ids(lm, prompts) == [ids[:-1] for ids in users]
    # an end token the prompt's own text holds is the user's: kept
    assert _prompt_ids(lm, ["The river ferry</s>"]) == [tok("The river ferry</s>")["input_ids"][:-1]]
    assert _prompt_ids(lm, ["The river ferry</s>"])[0][-1] == eos


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch's CUDA caching allocator")
def test_cuda_memory_pytorch_caches_unused_counts_as_available():
    # mem_get_info counts the blocks PyTorch's caching allocator keeps after a tensor is freed as taken; a new
    # tensor takes them first, and a process that had run a big forward before was refused logits it could hold
    from tf32lab.measure.generation import _available_bytes

    device = torch.device("cuda")
    block = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB, kept in the cache once freed
    del block
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    assert cached >= 1 << 28
    found = _available_bytes(device)
    # a margin for another process on the same GPU between the two readings
    assert found is not None and found >= torch.cuda.mem_get_info(device)[0] + (1 << 28) - (1 << 26)
    torch.cuda.empty_cache()




def test_cli_an_output_never_replaces_a_file_of_the_model_folder(llama_folder, tmp_path):
    # the spec's folder is read as a .py spec is: --json FOLDER/config.json wrote the report over the model's config,
    # and the folder loaded no more
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The cat\n")
    before = {p.name: p.read_bytes() for p in llama_folder.iterdir()}
    for args, name in ((["--generate", "1", "--prompts", str(prompts), "--json"], "config.json"),
                       (["--no-speed", "--html"], "model.safetensors")):
        done = cli_runner.run("check", f"hf:{llama_folder}", "--levels", "high", *args, f"{llama_folder}/./{name}",
                              timeout=300, preload=cli_runner.HF)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        line = done.stderr.strip()
        assert len(line.splitlines()) == 1 and f"{name} is a file of the model folder" in line, line
        assert done.stdout == "" and {p.name: p.read_bytes() for p in llama_folder.iterdir()} == before
    # a report written there before replaces nothing of the model's (hf:. from inside the folder, run again)
    (llama_folder / "report.json").write_text("{}\n")
    done = cli_runner.run("check", f"hf:{llama_folder}", "--levels", "high", "--generate", "1", "--prompts",
                          str(prompts), "--json", str(llama_folder / "report.json"), timeout=300,
                          preload=cli_runner.HF)
    assert done.returncode in (0, 1) and "levels" in (llama_folder / "report.json").read_text(), done.stderr
    (llama_folder / "report.json").unlink()  # the session's folder as the other tests find it


def test_half_precision_weights_are_decoded_in_float32_and_the_report_says_so(llama_folder, tmp_path):
    # the check of the same folder says so; the generation check said nothing, and a model served in bfloat16
    # (no TF32 in its matmuls) read as a float32 model's answer
    folder = tmp_path / "bf16"
    transformers.LlamaForCausalLM.from_pretrained(str(llama_folder)).to(torch.bfloat16).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(llama_folder)).save_pretrained(folder)
    report = tf32lab.check_generation(hf.causal_lm(str(folder)), new_tokens=1, prompts=["The cat"],
                                      levels=("high",))
    assert any("weights saved as bfloat16, decoded in float32" in note for note in report.notes), report.notes
    plain = tf32lab.check_generation(hf.causal_lm(str(llama_folder)), new_tokens=1, prompts=["The cat"],
                                     levels=("high",))
    assert not any("saved as" in note for note in plain.notes)



def test_cli_a_prompt_past_the_tokenizers_max_length_is_one_line(tmp_path):
    # GPT-2's tokenizer says model_max_length 1024, its table's length: transformers' "Token indices sequence length
    # is longer than the specified maximum ... will result in indexing errors" came before the check's own line
    tok = hf_builders.tokenizer(eos_token="</s>")
    tok.model_max_length = _POSITIONS
    folder = hf_builders.folder(tmp_path / "gpt2_like", hf_builders.llama(max_position_embeddings=_POSITIONS), tok)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(" ".join(["river"] * 40) + "\n")
    done = cli_runner.run("check", f"hf:{folder}", "--generate", "2", "--prompts", str(prompts), "--levels", "high",
                          timeout=300, preload=cli_runner.HF)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "has 32" in done.stderr, done.stderr


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_cli_an_output_never_replaces_a_file_of_a_hub_cache_snapshot(tmp_path, capsys, name):
    # a hub cache's snapshot folder links each file to a blob named by its hash: the name (a hash) and place
    # (blobs/) of the file the link leads to said it was no file of the folder, and --json SNAPSHOT/config.json
    # replaced the link with the report (the folder loaded no more); the blob by its own path is refused too
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "0123abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for file, blob in (("config.json", "9f2c41"), ("model.safetensors", "77ab03")):
        (blobs / blob).write_text("{}\n")
        (snapshot / file).symlink_to(os.path.relpath(blobs / blob, snapshot))
    before = {p.name: p.read_bytes() for p in blobs.iterdir()}
    blob = os.path.realpath(snapshot / name)
    for path in (snapshot / name, blob):
        assert cli.main(["check", f"hf:{snapshot}", "--levels", "high", "--json", str(path)]) == 2
        line = capsys.readouterr().err.strip()
        assert len(line.splitlines()) == 1 and "is a file of the model folder" in line, line
    assert {p.name: p.read_bytes() for p in blobs.iterdir()} == before


def test_cli_generate_refuses_a_folder_whose_checkpoint_lacks_its_output_head(tmp_path, capsys):
    # a checkpoint without its output head (untied, left out) had one drawn at random as the folder loaded, and was
    # decoded and judged as if trained (seeded, so at least alike in every run); now refused, naming the tensor
    import random

    import numpy
    from safetensors.torch import load_file, save_file

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = hf_builders.llama(max_position_embeddings=_POSITIONS, tie_word_embeddings=False)
    folder = hf_builders.folder(tmp_path / "headless", model, hf_builders.tokenizer(eos_token="</s>"))
    weights = folder / "model.safetensors"
    kept = {k: v for k, v in load_file(weights).items() if k != "lm_head.weight"}
    save_file(kept, weights, metadata={"format": "pt"})
    capsys.readouterr()  # save_pretrained's progress bar
    python, numpys = random.getstate(), numpy.random.get_state()
    try:
        with torch.random.fork_rng():  # the command seeds the process's streams, as a new process wants them
            code = cli.main(["check", f"hf:{folder}", "--generate", "2", "--levels", "high", "--json", "-"])
    finally:
        random.setstate(python), numpy.random.set_state(numpys)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    line = captured.err.strip()
    assert len(line.splitlines()) == 1 and "its weights lack 1 of the model's tensors (lm_head.weight), which " \
        "transformers would make at random" in line, line
