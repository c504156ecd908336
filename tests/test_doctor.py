"""doctor(): right about this machine, right about simulated ones, warnings that matter, JSON per its schema."""

from __future__ import annotations

import io
import json
import os
import subprocess
import threading

import jsonschema
import pytest
import rich.console
import torch

import cli_runner
import tf32lab
from tf32lab import Tf32LabError
from tf32lab.control import flags
from tf32lab.know import targets
from tf32lab.machine import doctor as diagnosis
from tf32lab.machine import hardware
from tf32lab.machine.hardware import Hardware
from tf32lab.report import doctor_text


def _codes(d) -> set[str]:
    return {w.code for w in d.warnings}


def _tf32lab(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return cli_runner.run(*args, module="tf32lab.cli", timeout=120, env={**os.environ, **(env or {})})


def test_doctor_is_right_about_this_machine():
    d = tf32lab.doctor()
    hw = d.hardware
    assert hw.simulated_as is None and hw.visible_cpus == os.cpu_count()
    assert hw.affinity_cpus == len(os.sched_getaffinity(0))
    assert len(hw.gpus) == torch.cuda.device_count()
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        cpu_flags = next(line for line in info if line.startswith("flags")).split()
    assert set(hw.isa) == {isa for isa in hardware.ISA if isa in cpu_flags}
    assert d.level == torch.get_float32_matmul_precision()
    assert d.threads == {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()}
    if not torch.cuda.is_available():
        assert hw.target in ("cpu", "cpu-amx") and d.recommendation.level == "highest"
        assert "no GPU" in d.recommendation.reason


def test_doctor_changes_nothing():
    before = flags.snapshot()
    tf32lab.doctor()
    tf32lab.doctor(Hardware.simulated("a100"))
    assert flags.snapshot() == before


@pytest.mark.parametrize("name, highest, high, medium, codes", [
    ("a100", "ieee", "tf32-rna", "tf32-rna", {"conv-tf32-at-highest", "medium-equals-high"}),
    ("h100", "ieee", "tf32-rne", "tf32-rne", {"conv-tf32-at-highest", "medium-equals-high"}),
    ("v100", "ieee", "ieee", "ieee", set()),
    ("t4", "ieee", "ieee", "ieee", set()),
    ("cpu-amx", "ieee", "ieee", "bf16-rne", set()),  # no TF32 without AMX-FP16 (tests/test_cpu_amx.py)
    ("cpu", "ieee", "ieee", "ieee", set()),
])
def test_what_each_level_does_on_simulated_machines(name, highest, high, medium, codes):
    d = tf32lab.doctor(Hardware.simulated(name))
    assert [d.levels[level]["matmul"] for level in tf32lab.LEVELS] == [highest, high, medium]
    assert _codes(d) - {"inductor-shape-padding"} == codes  # (that one: once this process has compiled anything)
    assert d.recommendation.level == ("high" if name in ("a100", "h100") else "highest")
    assert set(d.levels["highest"]) == set(diagnosis.FAMILIES)
    assert d.levels["high"]["linalg"] == "ieee"


def test_a100_convs_run_tf32_at_highest_and_the_fix_is_named():
    d = tf32lab.doctor(Hardware.simulated("a100"))
    assert d.levels["highest"]["conv"] == "tf32-rna"
    message = next(w.message for w in d.warnings if w.code == "conv-tf32-at-highest")
    assert "torch.backends.cudnn.conv.fp32_precision = 'ieee'" in message


def test_env_overrides_are_warned_and_change_the_table():
    off = tf32lab.doctor(Hardware.simulated("a100", env={"NVIDIA_TF32_OVERRIDE": "0"}))
    assert "env-override" in _codes(off) and off.levels["high"]["matmul"] == "ieee"
    assert off.levels["highest"]["conv"] == "ieee" and off.recommendation.level == "highest"


def test_the_cublas_override_only_changes_the_default_level(user_flags):
    # TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 makes 'high' the default; an explicit 'highest' still gives IEEE (measured
    # on an H100 with torch 2.11), so the table keeps IEEE at 'highest' and a level still has its effect.
    tf32lab.set_float32_matmul_precision("high")
    hw = Hardware.simulated("a100", env={"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"})
    d = tf32lab.doctor(hw)
    assert d.levels["highest"]["matmul"] == "ieee" and d.levels["high"]["matmul"] == "tf32-rna"
    assert "level-has-no-effect" not in _codes(d)
    message = next(w.message for w in d.warnings if w.code == "env-override")
    assert "default level is 'high'" in message and "explicit 'highest' still gives IEEE" in message
    assert hw.default_level == "high" and Hardware.simulated("a100").default_level == "highest"


def test_doctor_says_when_autoconfig_is_switched_off_or_its_switch_unreadable():
    off = tf32lab.doctor(Hardware.simulated("a100", env={"TF32LAB_DISABLE": "1"}))
    assert "changes nothing" in next(w.message for w in off.warnings if w.code == "autoconfig-disabled")
    unreadable = tf32lab.doctor(Hardware.simulated("a100", env={"TF32LAB_DISABLE": "maybe"}))
    assert "not understood" in next(w.message for w in unreadable.warnings if w.code == "autoconfig-disabled")
    assert "autoconfig-disabled" not in _codes(tf32lab.doctor(Hardware.simulated("a100", env={"TF32LAB_DISABLE": "0"})))


def test_cpu_quota_and_thread_warnings():
    d = tf32lab.doctor(Hardware.simulated("a100", cpus=8, quota=1.5, env={"OMP_NUM_THREADS": "8"}))
    assert {"cpu-quota", "threads-oversubscribed"} <= _codes(d)
    # What autoconfig would do: the explicit variable is honoured, and the cost is said.
    assert d.recommended_threads == 8 and "oversubscribes" in d.threads_reason
    assert tf32lab.doctor(Hardware.simulated("a100", cpus=8, quota=1.5)).recommended_threads == 1


def test_more_threads_than_usable_cpus_on_this_machine(user_flags):
    usable = hardware.detect().usable_cpus
    torch.set_num_threads(usable + 1)
    assert "threads-oversubscribed" in _codes(tf32lab.doctor())


NEW_API_ONLY = pytest.mark.skipif(not flags.NEW_API, reason="the mixed-API hazard exists with the per-backend API")


@NEW_API_ONLY
def test_mixed_api_hazard(user_flags):
    torch.backends.fp32_precision = "tf32"  # the new API, generic cell
    d = tf32lab.doctor()
    assert "mixed-api" in _codes(d)
    assert d.legacy["torch.get_float32_matmul_precision()"] is None  # it raises now
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.get_float32_matmul_precision()


@NEW_API_ONLY
def test_generic_setting_cut_off_by_explicit_values(user_flags):
    torch.set_float32_matmul_precision("highest")  # explicit ieee in cuda.matmul / mkldnn.matmul
    torch.backends.fp32_precision = "tf32"
    message = " ".join(w.message for w in tf32lab.doctor().warnings if w.code == "mixed-api")
    assert "has no effect on cuda.matmul, mkldnn.matmul" in message


def test_level_without_effect(user_flags):
    tf32lab.set_float32_matmul_precision("high")
    d = tf32lab.doctor(Hardware.simulated("v100"))
    assert "level-has-no-effect" in _codes(d)
    assert "level-has-no-effect" not in _codes(tf32lab.doctor(Hardware.simulated("a100")))


@pytest.mark.parametrize("name", [None, *targets.TARGETS])
def test_json_validates_against_the_schema(name):
    schema = diagnosis.schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    hw = None if name is None else Hardware.simulated(
        name, quota=1.5, env={"NVIDIA_TF32_OVERRIDE": "0", "OMP_NUM_THREADS": "64", "LOCAL_WORLD_SIZE": "2",
                              "HIPBLASLT_ALLOW_TF32": "1", "TF32LAB_DISABLE": "maybe"})
    jsonschema.validate(json.loads(tf32lab.doctor(hw).to_json()), schema)


def test_the_schema_takes_the_cells_and_values_of_other_and_newer_torches():
    data = json.loads(tf32lab.doctor().to_json())
    data["flags"]["cells"] = [{"cell": "xpu.math_sdp", "raw": "none", "effective": "ieee"},
                              {"cell": "cuda.matmul", "raw": "bfx9", "effective": "bfx9"},
                              {"cell": "mkldnn.matmul", "raw": "fp8x4", "effective": "fp8x4"}]
    data["flags"]["level"] = "unknown"
    jsonschema.validate(data, diagnosis.schema())
    data["flags"]["cells"][0]["cell"] = "xpu matmul"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, diagnosis.schema())


def test_cli_doctor_json_is_valid_and_about_this_machine():
    done = _tf32lab("doctor", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    jsonschema.validate(data, diagnosis.schema())
    assert data["hardware"]["visible_cpus"] == os.cpu_count()
    assert data["hardware"]["simulated_as"] is None
    assert len(data["hardware"]["gpus"]) == torch.cuda.device_count()


def test_cli_doctor_simulate_keeps_this_environment():
    done = _tf32lab("doctor", "--simulate", "a100", "--cpus", "8", "--quota", "1.5",
                    env={"NVIDIA_TF32_OVERRIDE": "0"})
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "simulated a100" in out and "warning | env-override | NVIDIA_TF32_OVERRIDE=0 is set" in out
    assert "warning | cpu-quota |" in out and "recommend | level 'highest' |" in out
    assert "recommend | threads 1 |" in out


def test_cli_doctor_text_on_this_machine():
    done = _tf32lab("doctor")
    assert done.returncode == 0, done.stderr
    assert "tf32lab doctor  this machine" in done.stdout and "what each level does here" in done.stdout
    assert f"{os.cpu_count()} visible" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--simulate", "a200"], "unknown target 'a200'"),
    (["--cpus", "4"], "--cpus and --quota describe a simulated machine"),
    (["--simulate", "a100", "--cpus", "0"], "bad number of CPUs '0'"),
    (["--simulate", "a100", "--quota", "-2"], "bad quota '-2'"),
])
def test_cli_doctor_bad_input(args, message):
    done = _tf32lab("doctor", *args)
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize("bad, message", [
    ("a100", "doctor() takes None (this machine) or a tf32lab.machine.hardware.Hardware: Hardware.simulated('a100'), "
             "not str 'a100'"),
    (8, "doctor() takes None (this machine) or a tf32lab.machine.hardware.Hardware, not int 8"),
])
def test_doctor_refuses_what_is_not_hardware(bad, message):
    before = flags.snapshot()
    with pytest.raises(tf32lab.Tf32LabError) as err:
        tf32lab.doctor(bad)
    assert str(err.value) == message
    assert flags.snapshot() == before


ROUNDED = ("tf32-rna", "tf32-rne", "tf32-rz", "bf16-rne")


def test_doctor_probes_what_each_level_really_does_here():
    # whatever this CPU's kernels do, the probe's answer and the warnings must agree with a fresh product
    d = tf32lab.doctor()
    assert d.probe is not None and set(d.probe) == set(tf32lab.LEVELS)
    assert d.probe["highest"].math == "same-as-highest" and d.probe["highest"].error < 1e-5
    a, b = (torch.randn(64, 1024, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    b = b.T.contiguous()
    with tf32lab.precision("highest"):
        highest = a @ b
    for level, found in d.probe.items():
        with tf32lab.precision(level):
            again = a @ b
        expected = d.levels[level]["matmul"]
        if found.math == "same-as-highest":
            assert found.same_bits
        if found.math in ROUNDED or expected != "ieee":
            # rounded operands show at 1e-4 and up on k = 1024
            rounded = (again.double() - a.double() @ b.double()).abs().max() / highest.abs().max() > 1e-5
            assert rounded == (found.math in ROUNDED), (level, found)
        agrees = found.math == expected or (found.math in ("same-as-highest", "ieee") and expected == "ieee")
        assert agrees or "probe-disagrees" in _codes(d)
    others = any(f.math == "ieee" for level, f in d.probe.items() if level != "highest")
    assert ("other-float32-kernel" in _codes(d)) == others


def test_probe_classifies_rounded_and_reordered_products():
    from tf32lab.machine import probe
    from tf32lab.numbers import formats

    a, b = probe._operands(torch.Generator().manual_seed(0))
    exact = {"float64": a.double() @ b.double(),
             "bf16-rne": formats.round_bf16(a).double() @ formats.round_bf16(b).double()}
    for rounding in ("rna", "rne", "rz"):
        exact[f"tf32-{rounding}"] = (formats.round_tf32(a, rounding).double()
                                     @ formats.round_tf32(b, rounding).double())
    scale = float(exact["float64"].abs().max())
    highest = a @ b
    reordered = a.flip(1) @ b.flip(0)  # the same sum in another order: float32 bits change
    assert not torch.equal(reordered, highest)
    assert probe._classify(highest, highest, exact, scale).math == "same-as-highest"
    assert probe._classify(reordered, highest, exact, scale).math == "ieee"
    for math in ("bf16-rne", "tf32-rna", "tf32-rne", "tf32-rz"):
        # a kernel that rounds its operands that way and sums in float32
        assert probe._classify(exact[math].float(), highest, exact, scale).math == math


def test_no_probe_for_a_simulated_machine_or_inside_emulation():
    assert tf32lab.doctor(Hardware.simulated("a100")).probe is None
    before = flags.snapshot()
    with tf32lab.emulate("a100"):
        assert tf32lab.doctor().probe is None
    assert flags.snapshot() == before


def test_doctor_in_a_thread_beside_a_scope_it_must_not_disturb_skips_the_probe():
    # the main thread entered precision("high") alone: its ops are unguarded, so no other thread may change the flag
    before = flags.snapshot()
    found = {}
    with tf32lab.precision("high"):
        worker = threading.Thread(target=lambda: found.update(d=tf32lab.doctor()))
        worker.start()
        worker.join()
        assert tf32lab.get_float32_matmul_precision() == "high"
    d = found["d"]
    assert d.probe is None and "probe-skipped" in _codes(d)
    jsonschema.validate(json.loads(d.to_json()), diagnosis.schema())
    assert flags.snapshot() == before


# -- Inductor settings, bfx9, values of a newer torch --------------------------------------------------------------
INDUCTOR_ENV = """
import json, sys
from tf32lab import inductor
assert "torch._inductor.config" not in sys.modules and "torch._dynamo" not in sys.modules
cells = {"cuda.matmul": "tf32", "cuda.conv": "tf32"}
print(json.dumps({
    "default": [c for c, _ in inductor.alerts(cells, True, {})],
    "padding asked": [c for c, _ in inductor.alerts(cells, True, {"TORCHINDUCTOR_SHAPE_PADDING": "1"})],
    "padding asked, no TF32": [c for c, _ in inductor.alerts(cells, False, {"TORCHINDUCTOR_SHAPE_PADDING": "1"})],
    "padding off": [c for c, _ in inductor.alerts(cells, True, {"TORCHINDUCTOR_SHAPE_PADDING": "0"})],
    "autotune": [c for c, _ in inductor.alerts(cells, True, {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"})],
    "autotune, same precision": [c for c, _ in inductor.alerts(
        cells, True, {"TORCHINDUCTOR_MAX_AUTOTUNE": "1", "TORCHINDUCTOR_FORCE_SAME_PRECISION": "1"})],
    "has force_same_precision": inductor.settings({})["force_same_precision"] is not None,
}))
assert "torch._inductor.config" not in sys.modules  # read from the environment, Inductor never imported
"""


def test_inductor_settings_from_the_environment_without_importing_inductor(tmp_path):
    # forked from the suite's CLI server (torch and tf32lab imported, Inductor and Dynamo not: the script's first
    # assert says so), not a fresh interpreter
    (tmp_path / "inductor_env.py").write_text(INDUCTOR_ENV)
    done = cli_runner.run(module="inductor_env", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    assert found["default"] == [] and found["padding off"] == [] and found["padding asked, no TF32"] == []
    assert found["padding asked"] == ["inductor-shape-padding"]
    # force_same_precision exists before torch 2.13 (off by default): there max-autotune's Triton GEMMs use TF32
    assert found["autotune"] == (["inductor-triton-tf32"] if found["has force_same_precision"] else [])
    assert found["autotune, same precision"] == []


def test_inductor_conv_as_matmul_read_live():
    from torch._inductor import config

    from tf32lab.machine import inductor

    with config.patch(conv_1x1_as_mm=True):  # Inductor's own way (its config module is no plain module)
        codes = [c for c, _ in inductor.alerts({"cuda.matmul": "ieee", "cuda.conv": "tf32"}, False)]
        assert codes == ["inductor-conv-as-matmul"]
        assert inductor.alerts({"cuda.matmul": "tf32", "cuda.conv": "tf32"}, False) == []
    assert inductor.alerts({"cuda.matmul": "ieee", "cuda.conv": "tf32"}, False) == []


def test_bfx9_and_values_of_a_newer_torch_are_named_never_read_as_highest():
    from tf32lab.know.levels import level_of

    assert level_of("bfx9", "ieee") == "bfx9" and level_of("bfx9", "bf16") == "medium"
    assert level_of("fp8x4", "ieee") == "unknown" and level_of("ieee", "int8") == "unknown"
    b200, h100 = targets.get("b200"), targets.get("h100")
    assert str(b200.math("matmul", {"cuda.matmul": "bfx9"})) == "bfx9"
    with pytest.raises(Tf32LabError, match=r"needs compute capability 10.0 .* 'h100' \(sm90\) PyTorch raises"):
        h100.math("matmul", {"cuda.matmul": "bfx9"})
    with pytest.raises(Tf32LabError, match=r"cuda.matmul holds 'fp8x4', a value this tf32lab does not know"):
        b200.math("matmul", {"cuda.matmul": "fp8x4"})
    # doctor's own view of such cells, from a table of rows as flags.read_cell_table() gives them
    rows = [("generic.all", "none", "none"), ("cuda.matmul", "bfx9", "bfx9"), ("mkldnn.matmul", "fp8x4", "fp8x4")]
    cells = {"cuda.matmul": "bfx9", "cuda.conv": "tf32", "mkldnn.matmul": "fp8x4"}
    for name, expected in (("b200", {"bfx9", "unknown-value"}), ("h100", {"bfx9", "unknown-value"})):
        hw = Hardware.simulated(name)
        table = diagnosis._level_table(hw, cells)
        alerts = diagnosis._warnings(hw, "unknown", table, rows, [], None, cells)
        assert expected <= {a.code for a in alerts}
        bfx9 = next(a.message for a in alerts if a.code == "bfx9")
        assert ("PyTorch raises" in bfx9) == (name == "h100")
    assert diagnosis._level_table(Hardware.simulated("cpu-amx"), {**cells})["highest"]["matmul"] == "ieee"


def test_rocm_gpus_map_to_their_targets_and_hipblaslt_tf32_is_shown():
    from tf32lab.machine.hardware import _target_for

    assert _target_for((9, 4), "AMD Instinct MI300X", amd=True) == "mi300"
    assert _target_for((9, 5), "AMD Instinct MI355X", amd=True) == "mi355"
    assert _target_for((10, 0), "NVIDIA B200") == "b200" and _target_for((9, 4), "NVIDIA H100 NVL") != "mi300"
    off = diagnosis.doctor(Hardware.simulated("mi300"))
    on = diagnosis.doctor(Hardware.simulated("mi300", env={"HIPBLASLT_ALLOW_TF32": "1"}))
    off_message, on_message = (next(w.message for w in d.warnings if w.code == "rocm-tf32") for d in (off, on))
    assert "IEEE" in off_message and "--target mi300" in on_message
    assert Hardware.simulated("mi300").cells_in_force({"cuda.matmul": "tf32"}) == {"cuda.matmul": "ieee"}


def test_doctor_knows_the_rank():
    d = tf32lab.doctor(Hardware.simulated("h100", env={"RANK": "1", "WORLD_SIZE": "2"}))
    data = json.loads(d.to_json())
    jsonschema.validate(data, diagnosis.schema())
    assert (data["hardware"]["rank"], data["hardware"]["world_size"]) == (1, 2)
    console = rich.console.Console(width=200, record=True, file=io.StringIO())
    for part in doctor_text.render(d):
        console.print(part)
    assert "1 of 2 (torchrun)" in console.export_text()


@pytest.mark.parametrize("name", ["cpu-amx", "cpu", "a100"])
def test_the_rnn_column_says_on_a_cpu_that_a_gru_runs_as_matmuls(name):
    # the rnn column is oneDNN's LSTM kernel's (mkldnn.rnn); on a CPU a GRU runs as aten GEMMs, bf16 at 'medium'
    # on an AMX CPU where the column says ieee (docs/gpu-results.md); cuDNN runs every RNN on a GPU
    console = rich.console.Console(width=200, record=True, file=io.StringIO())
    for part in doctor_text.render(tf32lab.doctor(Hardware.simulated(name))):
        console.print(part)
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    said = "on a CPU a GRU, an Elman RNN or an LSTM with proj_size runs as matmuls, at the matmul column's math" in text
    assert said == (name != "a100")
