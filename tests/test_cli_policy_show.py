"""`tf32lab policy show FILE --model SPEC` reads at 80 columns: a tree of module names, not cut dotted paths."""

from __future__ import annotations

import os
import textwrap

import cli_runner


def test_policy_show_is_a_tree_that_fits_80_columns(tmp_path):
    (tmp_path / "deep.py").write_text(textwrap.dedent("""
        import torch

        def make():
            inner = torch.nn.Sequential()
            inner.add_module("value_projection_head", torch.nn.Linear(4, 1))
            block = torch.nn.Sequential()
            block.add_module("very_long_block_name_for_attention", inner)
            model = torch.nn.Sequential()
            model.add_module("encoder_with_a_long_name", block)
            return model, torch.randn(2, 4)
    """), encoding="utf-8")
    (tmp_path / "p.json").write_text('{"schema_version": 1, "default": "high", "rules": '
                                     '[{"pattern": "*.value_projection_head", "level": "highest"}]}', encoding="utf-8")
    done = cli_runner.run("policy", "show", "p.json", "--model", "deep.py:make", module="tf32lab.cli", cwd=tmp_path,
                          timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    row = next(line for line in lines if "value_projection_head" in line)
    # the leaf's whole name, indented under its parents, with its level and the rule that gave it
    assert "    value_projection_head *" in row and "highest" in row and "…" not in row
    assert any("encoder_with_a_long_name" in line for line in lines)


def test_policy_show_names_each_modules_conv_math_when_the_policy_pins_one(tmp_path):
    (tmp_path / "convs.py").write_text(textwrap.dedent("""
        import torch

        def make():
            return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 4, 3)), torch.randn(1, 3, 8, 8)
    """), encoding="utf-8")
    (tmp_path / "p.toml").write_text('schema_version = 2\ndefault = "high"\n\n[[rules]]\npattern = "1"\n'
                                     'conv = "ieee"\n', encoding="utf-8")

    def show(*args):
        return cli_runner.run("policy", "show", "p.toml", *args, module="tf32lab.cli", cwd=tmp_path, timeout=120,
                              env={**os.environ, "COLUMNS": "80"})

    done = show("--model", "convs.py:make")
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if "kind" in line)
    assert "conv" in header
    rows = {line.split()[1]: line for line in done.stdout.splitlines() if line.split()[1:2] in (["0"], ["1"])}
    assert "high" in rows["1"] and "ieee" in rows["1"] and "rule 1" in rows["1"]
    assert "caller's" in rows["0"] and "ieee" not in rows["0"]
    assert "rule 1: 1 -> conv ieee" in done.stdout
    rules = show()
    assert rules.returncode == 0 and "inherited" in rules.stdout and "ieee" in rules.stdout


def test_policy_show_names_torchscript_modules_by_the_class_they_were_scripted_from(tmp_path):
    # silero-stress ships TorchScript models: every module of one is a RecursiveScriptModule, which names none
    (tmp_path / "scripted.py").write_text(textwrap.dedent("""
        import torch

        class Tagger(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.head = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

            def forward(self, x):
                return self.head(x)

        def make():
            return torch.jit.script(Tagger()), torch.randn(2, 4)
    """), encoding="utf-8")
    (tmp_path / "p.json").write_text('{"schema_version": 2, "default": "high", "rules": '
                                     '[{"pattern": "head", "level": "highest"}]}', encoding="utf-8")
    done = cli_runner.run("policy", "show", "p.json", "--model", "scripted.py:make", module="tf32lab.cli",
                          cwd=tmp_path, timeout=120, env={**os.environ, "COLUMNS": "80"})
    out = done.stdout + done.stderr
    assert "RecursiveScriptModule" not in out, out
    assert "on Tagger:" in out and "Sequential" in out and "Linear" in out
    # the refusal to pin a TorchScript model names the model's class, not RecursiveScriptModule
    assert "module 'Tagger' is TorchScript" in out
