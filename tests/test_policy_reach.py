"""Rules that cannot act through a module's forward: a pin reaches the ops that use the module's parameters
(nn.MultiheadAttention's out_proj), forward and backward; a rule that acts nowhere is named; tune writes no rule
for a module whose forward never runs, and says its margin and the faster candidate it passed over."""

from __future__ import annotations

import torch

import cli_runner
import tf32lab


def _encoder(d_model: int = 16, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model, 2, 2 * d_model, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _run(model, policy, x, train):
    model.train(train)
    with tf32lab.emulate("a100") as emu, policy.applied(model) as handle, torch.set_grad_enabled(train):
        out = model(x)
        if train:
            out.square().sum().backward()
        idle = handle.idle()
    return out.detach(), dict(emu.coverage), idle


def test_an_out_proj_pin_changes_the_output_forward_and_backward():
    model, x = _encoder(), torch.randn(3, 7, 16) * 3 + 2
    plain = tf32lab.Policy("high")
    pinned = tf32lab.Policy("high", [("*.self_attn.out_proj", "highest")])
    for train in (True, False):
        base, base_counts, _ = _run(model, plain, x, train)
        out, counts, idle = _run(model, pinned, x, train)
        assert not torch.equal(base, out)  # the pin acts (it left the output bit-identical)
        assert idle == []
        # exactly the out_proj products run IEEE: one a layer forward, and its two gradients backward
        ieee = sum(n for (op, math), n in counts.items() if math == "ieee")
        assert ("aten::addmm", "ieee") in counts and ieee == 2 * (3 if train else 1)
        assert not any(math == "ieee" for (_, math) in base_counts)


def test_the_pinned_output_is_the_one_computed_at_that_level_by_hand():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16) * 3 + 2
    with tf32lab.emulate("a100"), tf32lab.Policy("high", [("out_proj", "highest")]).applied(mha), \
            torch.no_grad():
        out = mha(x, x, x, need_weights=False)[0]
    with tf32lab.emulate("a100"), torch.no_grad():
        with tf32lab.precision("high"):
            q, k, v = torch.nn.functional.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, -1)
            heads = [t.reshape(2, 5, 2, 8).transpose(1, 2) for t in (q, k, v)]
            attn = torch.nn.functional.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(2, 5, 16)
        with tf32lab.precision("highest"):
            by_hand = mha.out_proj(attn)
    assert (out - by_hand).abs().max() < 1e-5 * by_hand.abs().max()


class _Kept(torch.nn.Module):
    """A module the parent keeps but never calls, and one whose weight it uses functionally."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.functional, self.never = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.GELU()

    def forward(self, x):
        return torch.nn.functional.linear(self.used(x), self.functional.weight)


def test_a_rule_that_acts_nowhere_is_named():
    model = _Kept()
    policy = tf32lab.Policy("high", [("functional", "highest"), ("never", "highest"), ("used", "highest")])
    with policy.applied(model) as handle:
        assert handle.idle() == []  # before any call: nothing to say
        model(torch.randn(2, 8))
        assert handle.idle() == [("never", "highest")]


def test_tune_writes_no_rule_for_a_module_whose_forward_never_runs():
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)
            self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
            self.down, self.up = torch.nn.Linear(512, 16), torch.nn.Linear(16, 512)

        def forward(self, x):
            h = self.down(torch.relu(self.b(torch.relu(self.a(x))))).reshape(-1, 8, 16)
            c, moved = torch.full_like(h, 1000.0), h + 1000.0  # TF32 loses h on the offset (tests/test_tune.py)
            diff = self.attn(moved, moved, moved, need_weights=False)[0] - self.attn(c, c, c, need_weights=False)[0]
            return self.up(diff.reshape(-1, 16))

    torch.manual_seed(0)
    workload = tf32lab.Workload(Net().eval(), torch.randn(1024, 512), name="attention")
    tuning = tf32lab.tune(workload, target="a100")
    assert tuning.passed and tuning.pinned == ("attn",)
    patterns = [rule.pattern for c in tuning.candidates for rule in c.policy.rules]
    assert "attn" in patterns and not any("out_proj" in p for p in patterns), patterns
    text = "\n".join(tuning.lines())
    assert "of the tolerance" in text and "of the tolerance" in tuning.to_html()
    assert 0 < tuning.to_dict()["margin"] <= 1


def test_margin_sentence_calls_a_thin_margin_thin():
    from tf32lab.decide.tune import margin

    assert "thin margin" in margin(0.997) and "0.997" in margin(0.997)
    assert "thin" not in margin(0.2)


def test_tune_says_why_it_passed_over_a_faster_passing_candidate():
    from types import SimpleNamespace

    from tf32lab.decide.tune import Candidate, _Search

    safe, mix = tf32lab.Policy("highest"), tf32lab.Policy("high", [("attn", "highest")])
    candidates = [Candidate(safe, (), True, 0.1, 1.0, 1.0, "uniform highest"),
                  Candidate(tf32lab.Policy("high"), (), False, 20.0, 0.9, 1.11, "uniform high"),
                  Candidate(mix, ("attn",), True, 0.1, 0.95, 1.05, "pin the 1 worst by error per time lost")]
    said = _Search._passed_over(SimpleNamespace(candidates=candidates), safe, 1.0)
    assert "'pin the 1 worst by error per time lost'" in said and "1.05x faster" in said and "1.10x" in said
    assert _Search._passed_over(SimpleNamespace(candidates=candidates), mix, 0.95) == ""  # nothing faster passed


class _Spare(torch.nn.Module):
    """An encoder beside a module kept but never called: a rule on it cannot act."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.spare = _encoder(), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.enc(x)


_SPEC = '''
import torch
import tf32lab
import test_policy_reach


def make():
    return tf32lab.Workload(test_policy_reach._Spare(), torch.randn(2, 5, 16), name="kept")
'''


def test_check_with_a_policy_names_a_rule_that_did_not_act():
    policy = tf32lab.Policy("high", [("*.self_attn.out_proj", "highest"), ("spare", "highest")])
    workload = tf32lab.Workload(_Spare(), torch.randn(2, 5, 16), name="kept")
    report = tf32lab.check(workload, levels=("high",), policy=policy, speed=False)
    idle = [n for n in report.notes if "did not act" in n]
    assert len(idle) == 1 and "'spare' -> highest" in idle[0] and "out_proj" not in idle[0], report.notes
    assert any("did not act" in n for n in report.to_dict()["notes"])


def test_policy_show_names_a_rule_that_cannot_act(tmp_path):
    import os

    (tmp_path / "kept.py").write_text(_SPEC)
    (tmp_path / "policy.json").write_text(tf32lab.Policy(
        "high", [("*.self_attn.out_proj", "highest"), ("spare", "highest")]).to_json())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = cli_runner.run("policy", "show", "policy.json", "--model", "kept.py:make", module="tf32lab.cli",
                          cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if "did not act" in line]
    assert len(lines) == 1 and "'spare' -> highest" in lines[0] and "out_proj" not in lines[0], done.stdout


def test_a_pin_a_fused_layer_overrides_is_named_and_one_it_honours_is_not():
    # In eval without gradients nn.TransformerEncoderLayer runs one fused op for the whole layer, at the most
    # accurate level among its weights' modules: a pin of linear1 below the layer's level changes nothing, yet
    # idle() counted linear1 as reached by that op and named nothing (policy show and check said it acted).
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    for default, level, idle in (("highest", "high", [("linear1", "high")]), ("high", "highest", [])):
        with tf32lab.Policy(default, [("linear1", level)]).applied(layer) as handle, torch.no_grad():
            layer(x)
            assert handle.idle() == idle, (default, level)
    # with gradients PyTorch leaves the fast path: linear1 runs its own forward, at its own level
    with tf32lab.Policy("highest", [("linear1", "high")]).applied(layer) as handle:
        layer(x)
        assert handle.idle() == []
