"""Every JSON tf32lab writes loads with a strict parser: a non-finite number is a string, never a bare NaN.

Real results with real non-finite values in them (an output that overflows in float32, a workload with no work to
time, a probe that measured nothing), read back the way ``jq`` or a browser's ``JSON.parse`` would.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import textwrap
from pathlib import Path

import pytest
import torch

import cli_runner
import tf32lab
from tf32lab.machine.hardware import Hardware
from tf32lab.machine.probe import ProbeResult
from tf32lab.numbers.files import finite, write_json
from tf32lab.speed.prediction import predict

ROOT = Path(__file__).resolve().parents[1]


def strict(text: str):
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity``, as strict parsers do."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def strings(data) -> set:
    if isinstance(data, dict):
        return set().union(*map(strings, data.values())) if data else set()
    if isinstance(data, list):
        return set().union(*map(strings, data)) if data else set()
    return {data} if isinstance(data, str) else set()


def test_the_strict_reader_refuses_a_bare_nan():
    with pytest.raises(ValueError, match="not JSON: NaN"):
        strict(json.dumps({"x": math.nan}))


class _Overflows(torch.nn.Module):
    """exp(30 x) overflows in float32 where it does not in float64: errors of inf and a cosine of NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.exp(self.linear(x) * 30)


def test_a_report_with_infinite_errors_is_strict_json_in_the_file_and_the_string(tmp_path):
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(_Overflows(), torch.randn(3, 4) * 5), levels=("highest", "high"))
    text = report.to_json(tmp_path / "r.json")
    assert (tmp_path / "r.json").read_text() == text and text.endswith("}\n")
    found = strings(strict(text))
    assert {"inf", "nan"} <= found, found


def test_a_speed_report_with_nothing_to_time_is_strict_json(tmp_path):
    report = predict(tf32lab.Workload(torch.nn.Identity(), torch.randn(3, 4)), "a100")
    assert math.isnan(report.levels[0].speedup)  # 0 s over 0 s: the real case this guards
    data = strict(report.to_json(tmp_path / "s.json"))
    assert data["levels"][0]["speedup"] == "nan" and strict((tmp_path / "s.json").read_text()) == data


def test_a_diagnosis_with_an_unmeasured_probe_is_strict_json(tmp_path):
    found = tf32lab.doctor(Hardware.simulated("a100"))
    found = dataclasses.replace(found, probe={"highest": ProbeResult("ieee", math.nan, True)})
    data = strict(found.to_json(tmp_path / "d.json"))
    assert data["probe"]["levels"]["highest"]["error"] == "nan"
    assert strict((tmp_path / "d.json").read_text()) == data


def test_the_speed_command_writes_strict_json_to_stdout_and_to_a_file(tmp_path):
    (tmp_path / "idle.py").write_text(textwrap.dedent("""
        import torch, tf32lab
        def make():
            return tf32lab.Workload(torch.nn.Identity(), torch.randn(3, 4))
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    for out in ("-", "speed.json"):
        done = cli_runner.run("speed", "idle.py:make", "--json", out, cwd=tmp_path, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        text = done.stdout if out == "-" else (tmp_path / out).read_text()
        assert strict(text)["predicted"]["levels"][0]["speedup"] == "nan"


def test_write_json_makes_every_non_finite_float_a_string_and_refuses_what_json_cannot_hold(tmp_path):
    data = {"a": [math.inf, (-math.inf, 1.5)], "b": {"c": math.nan}, "d": None, "e": "nan"}
    assert finite(data) == {"a": ["inf", ["-inf", 1.5]], "b": {"c": "nan"}, "d": None, "e": "nan"}
    assert strict(write_json(tmp_path / "x.json", data)) == finite(data)
    with pytest.raises(TypeError):
        write_json(tmp_path / "y.json", {"t": torch.zeros(1)})
    assert not (tmp_path / "y.json").exists()  # nothing written when the text cannot be made
