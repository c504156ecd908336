"""Random draws: every row of check, check_training and tune draws the same values, float64's reference included;
lazy modules start every row from one set of weights; two checks at once in two threads are refused."""

from __future__ import annotations

import textwrap
import threading

import pytest
import torch

import cli_runner
import tf32lab
from tf32lab.errors import Tf32LabError
from tf32lab.measure.draws import RANDOM_OPS, SameDraws
from tf32lab.measure.reference import Float64Run

F = torch.nn.functional


def _calls(dtype: torch.dtype) -> dict:
    x = torch.linspace(-1, 1, 40, dtype=dtype).reshape(5, 8)
    p = torch.rand(5, 8, generator=torch.Generator().manual_seed(5)).to(dtype)
    return {
        "randn_like": lambda: torch.randn_like(x),
        "rand_like": lambda: torch.rand_like(x),
        "randn": lambda: torch.randn(5, 8, dtype=dtype),
        "rand": lambda: torch.rand(5, 8, dtype=dtype),
        "randint": lambda: torch.randint(0, 100, (5, 8), dtype=dtype),
        "randint_like": lambda: torch.randint_like(x, 0, 100),
        "randperm": lambda: torch.randperm(40),
        "normal_": lambda: x.clone().normal_(0.5, 2.0),
        "uniform_": lambda: x.clone().uniform_(-2, 3),
        "exponential_": lambda: x.clone().exponential_(),
        "cauchy_": lambda: x.clone().cauchy_(),
        "log_normal_": lambda: x.clone().log_normal_(),
        "geometric_": lambda: x.clone().geometric_(0.3),
        "random_": lambda: x.clone().random_(),
        "bernoulli": lambda: torch.bernoulli(p),
        "bernoulli_ float": lambda: x.clone().bernoulli_(0.3),
        "bernoulli_ tensor": lambda: x.clone().bernoulli_(p),
        "multinomial": lambda: torch.multinomial(p + 0.1, 3),
        "poisson": lambda: torch.poisson(p * 4),
        "normal(tensor, tensor)": lambda: torch.normal(x, p + 0.5),
        "normal(tensor, float)": lambda: torch.normal(x, 0.5),
        "normal(float, tensor)": lambda: torch.normal(0.25, p + 0.5),
        "normal(float, float, size)": lambda: torch.normal(0.0, 1.0, (5, 8), dtype=dtype),
        "dropout": lambda: F.dropout(x, 0.4, training=True),
        "alpha_dropout": lambda: F.alpha_dropout(x, 0.4, training=True),
        "dropout1d": lambda: F.dropout1d(x.reshape(1, 5, 8), 0.4, training=True),
        "rrelu": lambda: F.rrelu(x, training=True),
        "_standard_gamma": lambda: torch._standard_gamma(p + 0.5),
        "_sample_dirichlet": lambda: torch._sample_dirichlet(p + 0.5),
        "binomial": lambda: torch.binomial(p * 0 + 10, p),
    }


@pytest.mark.parametrize("name", sorted(_calls(torch.float32)))
def test_a_float64_run_draws_what_a_float32_row_draws(name):
    torch.manual_seed(3)
    drawn = _calls(torch.float32)[name]()
    torch.manual_seed(3)
    with Float64Run():  # check's reference: the float32 model, every op widened
        reference = _calls(torch.float32)[name]()
    torch.manual_seed(3)
    with SameDraws():  # check_training's float64 row: a .double() copy
        wide = _calls(torch.float64)[name]()
    for got in (reference, wide):
        assert got.dtype == (torch.int64 if drawn.dtype == torch.int64 else torch.float64)
        torch.testing.assert_close(got.double(), drawn.double(), rtol=1e-6, atol=1e-7)


def test_the_list_covers_every_op_that_takes_a_generator():
    readers = {"aten::seed", "aten::manual_seed", "aten::initial_seed"}  # they set or read the state, draw nothing
    taking = {s.name.split("::")[1] for s in torch._C._jit_get_all_schemas()
              if s.name.startswith("aten::") and s.name not in readers
              and any("Generator" in str(a.type) for a in s.arguments)}
    listed = {str(op).split(".")[-1] for op in RANDOM_OPS}
    assert taking and taking <= listed, sorted(taking - listed)
    assert "native_dropout" in listed  # draws from the default generator without taking one


# -- a model that samples: a VAE's reparameterisation ---------------------------------------------------------
class _VAE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mu, self.logvar = torch.nn.Linear(32, 64), torch.nn.Linear(64, 8), torch.nn.Linear(64, 8)
        self.dec = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        return self.dec(mu + torch.randn_like(mu) * torch.exp(0.5 * logvar))


def _vae() -> tuple[torch.nn.Module, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _VAE(), torch.randn(16, 32)


def _training(model: torch.nn.Module, x: torch.Tensor) -> tf32lab.TrainingWorkload:
    return tf32lab.TrainingWorkload(model, [(x,)] * 3, inputs=lambda b: b[0],
                                    loss=lambda out, b: (out - b[0]).pow(2).mean(), name="vae")


def test_check_of_a_sampling_model_compares_the_same_noise():
    model, x = _vae()
    report = tf32lab.check(tf32lab.Workload(model, x), introduced="all", levels=("highest", "high"), target="a100")
    highest = report.level("highest")
    assert highest.outputs[0].normwise < 1e-6 and highest.unstable is None  # 1.2 when float64 drew its own noise
    assert report.level("high").outputs[0].normwise > 1e-5  # the level's own error is still seen
    assert all(layer.introduced < 1e-6 for layer in highest.layers)


class _NoisyLayer(torch.nn.Module):
    """A layer that draws inside its own call: its reruns must draw what the reference's call drew."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        y = torch.rand_like(x) + x @ self.weight  # a matmul of its own: a layer
        return y * torch.rand_like(y)


def test_a_layer_rerun_draws_what_its_reference_call_drew():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), _NoisyLayer(), torch.nn.Linear(16, 4))
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(8, 16)), introduced="all",
                           levels=("highest",), target="a100")
    introduced = {layer.name: layer.introduced for layer in report.level("highest").layers}
    assert introduced["1"] < 1e-6, introduced


def test_check_leaves_the_callers_random_state_as_it_was():
    model, x = _vae()
    torch.manual_seed(7)
    before = torch.get_rng_state()
    tf32lab.check(tf32lab.Workload(model, x), levels=("highest",), target="a100", speed=False)
    assert torch.equal(torch.get_rng_state(), before)


def test_check_training_float32s_own_drift_is_rounding_not_noise():
    model, x = _vae()
    report = tf32lab.check_training(_training(model, x), levels=("highest",), target="a100", steps=2, speed=False)
    assert report.floor.deviations[0] < 1e-6, report.floor.deviations  # 5e-2 when float64 drew its own noise


def test_a_level_past_a_tight_tolerance_fails_once_the_noise_is_the_same():
    model, x = _vae()
    report = tf32lab.check_training(_training(model, x), levels=("medium",), target="a100", steps=2,
                                    tolerance=1e-6, speed=False)
    medium = report.level("medium")
    assert report.floor.drift < 1e-6 and medium.divergence_step is not None
    assert not medium.passed and not report.passed  # passed beside float32's noise-made 5e-2 drift before


def test_cli_check_and_check_train_of_a_sampling_model(tmp_path):
    (tmp_path / "vae.py").write_text(textwrap.dedent("""
        import torch
        import tf32lab

        class VAE(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.enc, self.mu = torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)
                self.logvar, self.dec = torch.nn.Linear(64, 8), torch.nn.Linear(8, 32)

            def forward(self, x):
                h = torch.tanh(self.enc(x))
                mu, logvar = self.mu(h), self.logvar(h)
                return self.dec(mu + torch.randn_like(mu) * torch.exp(0.5 * logvar))

        def make():
            torch.manual_seed(0)
            return VAE(), torch.randn(16, 32)

        def train():
            model, x = make()
            return tf32lab.TrainingWorkload(model, [(x,)] * 2, inputs=lambda b: b[0],
                                            loss=lambda out, b: (out - b[0]).pow(2).mean())
    """))
    def check(*args):  # a real process each, forked from the suite's CLI server (torch imported once)
        return cli_runner.run("check", *args, module="tf32lab.cli", timeout=300, cwd=tmp_path)

    done = check("vae.py:make", "--levels", "highest", "--json", "out.json")
    assert done.returncode == 0, done.stdout + done.stderr
    import json

    found = json.loads((tmp_path / "out.json").read_text())
    assert found["levels"][0]["outputs"][0]["normwise"] < 1e-6
    done = check("vae.py:train", "--train", "--levels", "highest")
    assert done.returncode == 0 and "PASSED" in done.stdout, done.stdout + done.stderr


# -- lazy modules ---------------------------------------------------------------------------------------------
def _lazy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LazyLinear(32), torch.nn.Tanh(), torch.nn.LazyLinear(4))


def test_check_training_starts_every_row_from_one_set_of_lazy_weights():
    model = _lazy()
    x = torch.randn(16, 8)
    w = tf32lab.TrainingWorkload(model, [(x, torch.randn(16, 4))] * 2, inputs=lambda b: b[0],
                                 loss=lambda out, b: (out - b[1]).pow(2).mean(), name="lazy")
    report = tf32lab.check_training(w, levels=("highest",), target="a100", speed=False)
    assert report.floor.drift < 1e-6, report.floor.deviations  # 0.4 when each row made its own weights
    assert max(e.normwise for e in report.floor.weights) < 1e-5
    assert any("lazy module(s) '0', '2' made once" in note for note in report.notes), report.notes
    assert isinstance(model[0].weight, torch.nn.parameter.UninitializedParameter)  # the caller's model is not run


def test_check_makes_a_lazy_model_once_before_the_reference():
    model = _lazy()
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(16, 8)), levels=("highest",), target="a100")
    assert report.level("highest").outputs[0].normwise < 1e-6
    assert any("lazy module(s) '0', '2' made once" in note for note in report.notes), report.notes
    assert model[0].weight.dtype == torch.float32 and model[0].weight.shape == (32, 8)


# -- two checks at once ---------------------------------------------------------------------------------------
_INSIDE, _GO_ON = threading.Event(), threading.Event()  # module-level: a model with an Event cannot be copied


class _Waits(torch.nn.Module):
    """Holds its check in its forward until told to go on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x):
        _INSIDE.set()
        _GO_ON.wait(timeout=60)
        return F.dropout(self.linear(x), 0.3, training=True)


def _mlp_training(model: torch.nn.Module, name: str) -> tf32lab.TrainingWorkload:
    torch.manual_seed(1)
    data = [(torch.randn(8, 8), torch.randn(8, 1))] * 2
    return tf32lab.TrainingWorkload(model, data, inputs=lambda b: b[0], name=name,
                                    loss=lambda out, b: (out - b[1]).pow(2).mean())


def test_a_second_check_in_another_thread_is_refused_in_one_line():
    _INSIDE.clear()
    _GO_ON.clear()
    first = _mlp_training(_Waits(), "first")
    second = _mlp_training(torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Dropout(0.3)), "second")
    results: dict[str, object] = {}

    def run_first() -> None:
        try:
            results["first"] = tf32lab.check_training(first, levels=("highest",), speed=False)
        except BaseException as exc:  # handed to the test's thread
            results["first"] = exc

    thread = threading.Thread(target=run_first, name="first-check")
    thread.start()
    try:
        while not _INSIDE.wait(timeout=0.1):
            assert thread.is_alive(), results
        with pytest.raises(Tf32LabError) as caught:
            tf32lab.check_training(second, levels=("highest",), speed=False)
        with pytest.raises(Tf32LabError):
            tf32lab.check(tf32lab.Workload(torch.nn.Linear(8, 1), torch.randn(4, 8)), levels=("highest",))
    finally:
        _GO_ON.set()
        thread.join(timeout=120)
    message = str(caught.value)
    assert "\n" not in message and "'first-check'" in message and "one after another" in message
    assert isinstance(results["first"], tf32lab.report.training.TrainingReport) and results["first"].passed
    assert results["first"].floor.drift < 1e-6
    # and once the first is done, the second runs
    assert tf32lab.check_training(second, levels=("highest",), speed=False).floor.drift < 1e-6


class _OwnFloat64(torch.nn.Module):
    """Draws noise in float64 itself, as its float32 rows do too: the reference must not narrow those draws."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.l1, self.l2, self.how = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), how

    def forward(self, x):
        h = self.l1(x)
        if self.how == "dtype":
            noise = torch.randn(h.shape, dtype=torch.float64)
        elif self.how == "like":
            noise = torch.rand_like(h.double())
        else:
            noise = torch.empty(h.shape, dtype=torch.float64).normal_()
        return self.l2(torch.tanh((h.double() + noise).float()))


@pytest.mark.parametrize("how", ["dtype", "like", "in_place"])
def test_a_draw_the_model_makes_in_float64_is_the_same_in_every_row(how):
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(_OwnFloat64(how), torch.randn(6, 8)), levels=("highest",), speed=False)
    assert report.level("highest").outputs[0].normwise < 1e-6  # 1.2 when the reference drew them at float32
    torch.manual_seed(0)
    workload = tf32lab.TrainingWorkload(_OwnFloat64(how), [(torch.randn(6, 8), torch.randn(6, 4)) for _ in range(2)],
                                loss=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]),
                                inputs=lambda batch: batch[0])
    floor = tf32lab.check_training(workload, levels=("high",), tolerance=1e-6).floor
    assert floor.deviations[0] < 1e-6, floor.deviations  # float32's own drift: 1.2e-2 with other draws


class _SeededByNumpy(torch.nn.Module):
    """Noise from a generator seeded off NumPy's global stream, as torchsde's ``sdeint`` seeds its Brownian motion
    (``entropy = np.random.randint(0, 2**31 - 1)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        import numpy as np

        generator = torch.Generator().manual_seed(int(np.random.randint(0, 2**31 - 1)))
        return self.linear(x + torch.randn(x.shape, generator=generator))


class _PythonAndNumpyNoise(torch.nn.Module):
    """A layer whose own call draws from NumPy's and Python's global streams, and no PyTorch random op."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        import random

        import numpy as np

        noise = torch.from_numpy(np.random.standard_normal(tuple(x.shape)).astype("float32"))
        return (x + noise) @ self.weight * random.uniform(0.5, 2.0)


def test_every_row_draws_from_numpy_and_python_where_the_others_do():
    import random

    import numpy as np

    torch.manual_seed(0)
    np.random.seed(3)
    random.seed(3)
    before = np.random.get_state(), random.getstate()
    report = tf32lab.check(tf32lab.Workload(_SeededByNumpy(), torch.randn(8, 16)), levels=("highest", "high"),
                           target="a100", speed=False)
    highest = report.level("highest")
    assert highest.outputs[0].normwise < 1e-6 and highest.unstable is None  # 1.07: each row had another seed
    assert report.passed
    assert _same(np.random.get_state(), before[0]) and random.getstate() == before[1]  # the caller's, as they were


def _same(a, b) -> bool:
    return all(bool((x == y).all()) if hasattr(x == y, "all") else x == y for x, y in zip(a, b))


def test_a_layer_drawing_from_numpy_and_python_reruns_on_what_its_call_drew():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), _PythonAndNumpyNoise(), torch.nn.Linear(16, 4))
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(8, 16)), introduced="all",
                           levels=("highest",), target="a100",
                           speed=False)
    introduced = {layer.name: layer.introduced for layer in report.level("highest").layers}
    assert introduced["1"] < 1e-6, introduced  # 1.7: its reruns drew other numbers than its reference call


def test_check_training_rows_draw_from_numpy_alike():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), _PythonAndNumpyNoise(), torch.nn.Linear(16, 4))
    batches = [torch.randn(8, 16) for _ in range(3)]
    workload = tf32lab.TrainingWorkload(model, batches, loss=lambda out, b: out.pow(2).mean())
    report = tf32lab.check_training(workload, levels=("highest",), target="a100", speed=False)
    assert report.floor.deviations[0] < 1e-6, report.floor.deviations  # 2.0: float64 and float32 drew apart


def test_attention_with_dropout_is_sent_to_the_math_path():
    # A fused attention kernel on a GPU draws its dropout mask inside, from its own offsets: on an H200 the
    # memory-efficient kernel kept other weights than the float64 reference's math path, and a BERT's float32 row
    # drifted 8.6e-05 from float64 for it. Native GPU rows send such calls to the math path, the rest untouched.
    from torch.utils._python_dispatch import TorchDispatchMode

    from tf32lab.measure.draws import MathPathDropout

    efficient_on: list[bool] = []

    class Backends(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.bmm.default:  # the math path's products
                efficient_on.append(torch.backends.cuda.mem_efficient_sdp_enabled())
            return func(*args, **(kwargs or {}))

    q = torch.randn(2, 3, 8, 4, generator=torch.Generator().manual_seed(1))
    assert torch.backends.cuda.mem_efficient_sdp_enabled()
    with MathPathDropout() as route, Backends():
        torch.manual_seed(0)
        dropped = F.scaled_dot_product_attention(q, q, q, None, 0.5)
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
    assert route.rerouted == 1 and efficient_on == [False, False]  # only the call with dropout, on the math path
    assert torch.backends.cuda.mem_efficient_sdp_enabled()  # the backends put back
    torch.manual_seed(0)
    assert torch.equal(dropped, F.scaled_dot_product_attention(q, q, q, dropout_p=0.5))  # the CPU's own path


def test_a_check_on_the_cpu_sends_nothing_to_the_math_path():
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = attention

        def forward(self, x):
            return self.attention(x, x, x, need_weights=False)[0]

    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(2))
    workload = tf32lab.TrainingWorkload(Net(), [(x, torch.zeros(4, 6, 8))] * 2, loss=lambda o, b: o.pow(2).mean(),
                                        inputs=lambda b: b[0])
    report = tf32lab.check_training(workload, levels=("highest",), target="native", speed=False)
    assert not any("math path" in note for note in report.notes)
    assert report.floor.drift < 1e-5  # on the CPU dropout's masks already match: float32's own drift


def test_multihead_attentions_dropout_is_sent_to_the_math_path():
    # nn.MultiheadAttention (every nn.Transformer layer, dropout 0.1 by default) calls SDPA with its dropout inside
    # F.multi_head_attention_forward, where a function mode is off: the mode sends the whole call
    from torch.utils._python_dispatch import TorchDispatchMode

    from tf32lab.measure.draws import MathPathDropout

    efficient_on: list[bool] = []

    class Backends(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.bmm.default:
                efficient_on.append(torch.backends.cuda.mem_efficient_sdp_enabled())
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    with MathPathDropout() as route:
        attention(x, x, x, need_weights=True)  # weights: bmm and F.dropout, no SDPA
        attention.eval()(x, x, x, need_weights=False)  # no dropout
        assert route.rerouted == 0
        with Backends():
            attention.train()(x, x, x, need_weights=False)
    assert route.rerouted == 1 and efficient_on and not any(efficient_on)
    assert torch.backends.cuda.mem_efficient_sdp_enabled()
