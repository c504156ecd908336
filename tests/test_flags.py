"""tf32lab.control.flags: complete, comparable snapshots; exact restore; no mixed-API errors."""

from __future__ import annotations

import pytest
import torch

from tf32lab.control import flags
from tf32lab.know.levels import BACKEND_VALUES, LEVELS

pytestmark = pytest.mark.usefixtures("user_flags")  # these tests write PyTorch's flags as a user would


def test_snapshot_covers_every_precision_flag_of_this_torch():
    names = {name for name, _ in flags.snapshot()}
    if flags.NEW_API:
        for backend, op in [("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("cuda", "conv"),
                            ("cuda", "rnn"), ("mkldnn", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv"),
                            ("mkldnn", "rnn")]:
            assert f"fp32_precision.{backend}.{op}" in names
    else:
        assert {"float32_matmul_precision", "cudnn.allow_tf32"} <= names
    assert "cuda.matmul.allow_fp16_reduced_precision_reduction" in names
    assert "cuda.matmul.allow_bf16_reduced_precision_reduction" in names


def test_snapshots_compare_and_diff():
    a = flags.snapshot()
    assert a == flags.snapshot()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    b = flags.snapshot()
    assert a != b
    assert [name for name, _, _ in a.diff(b)] == ["cuda.matmul.allow_bf16_reduced_precision_reduction"]
    assert "allow_bf16_reduced_precision_reduction" in repr(b)
    with pytest.raises(KeyError, match="no flag 'nope'"):
        b["nope"]


def test_restore_brings_back_every_flag_after_both_api_generations_were_used():
    before, seen = flags.snapshot(), _legacy_view()
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    if flags.NEW_API:
        torch.backends.fp32_precision = "tf32"
        torch.backends.mkldnn.conv.fp32_precision = "bf16"
        torch.backends.cudnn.rnn.fp32_precision = "ieee"
    assert flags.snapshot() != before
    flags.restore(before)
    assert flags.snapshot() == before
    assert _legacy_view() == seen  # PyTorch's stored legacy values too (cuDNN's was left stale once)


@pytest.mark.skipif(not flags.NEW_API, reason="raw 'none' cells exist only in the per-backend API")
def test_raw_values_tell_inherited_from_explicit():
    torch.backends.fp32_precision = "tf32"  # every 'none' cell below now reads 'tf32'
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # explicit, same value
    snap = flags.snapshot()
    assert snap["fp32_precision.cuda.matmul"] == "tf32"
    assert snap["fp32_precision.mkldnn.matmul"] == "none"
    assert snap["fp32_precision.generic.all"] == "tf32"
    # restoring must keep the inheritance: change the parent and the 'none' cell follows, the explicit one not
    flags.restore(snap)
    torch.backends.fp32_precision = "ieee"
    assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"


@pytest.mark.parametrize("level", LEVELS)
def test_write_level_writes_exactly_the_level_cells(level):
    before = flags.snapshot()
    flags.write_level(level)
    changed = {name: new for name, _, new in before.diff(flags.snapshot())}
    if flags.NEW_API:
        cuda, mkldnn = BACKEND_VALUES[level]
        expected = {"fp32_precision.cuda.matmul": cuda, "fp32_precision.mkldnn.matmul": mkldnn}
        if level != "highest":  # and PyTorch's stored legacy level
            expected["float32_matmul_precision"] = level
        assert changed == expected
    assert flags.read_level() == level


@pytest.mark.skipif(not flags.NEW_API, reason="the mixed-API error exists only with the per-backend API")
def test_read_level_where_torch_itself_raises():
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        torch.get_float32_matmul_precision()
    except RuntimeError as exc:
        assert "mix of the legacy and new" in str(exc) or "without a specific backend" in str(exc)
    assert flags.read_level() == "medium"


def test_restore_refuses_anything_but_a_snapshot():
    with pytest.raises(TypeError, match=r"flags\.Snapshot"):
        flags.restore({"fp32_precision.cuda.matmul": "tf32"})


def _legacy_view() -> tuple:
    """What code using PyTorch's legacy API sees; 'raises' where its reader raises."""
    out = []
    for read in (torch.get_float32_matmul_precision, lambda: torch.backends.cuda.matmul.allow_tf32,
                 lambda: torch.backends.cudnn.allow_tf32):
        try:
            out.append(read())
        except RuntimeError:
            out.append("raises")
    return tuple(out)


@pytest.mark.skipif(not flags.NEW_API, reason="the stored legacy level exists beside the per-backend cells only")
@pytest.mark.parametrize("level", LEVELS)
def test_the_stored_legacy_level_is_restored(level, user_flags):
    # PyTorch keeps the legacy level apart from the cells: writing the cells back alone left
    # torch.get_float32_matmul_precision() answering the old level and allow_tf32 raising.
    before, seen = flags.snapshot(), _legacy_view()
    torch.set_float32_matmul_precision(level)
    torch.backends.fp32_precision = "tf32"
    assert flags.snapshot()["float32_matmul_precision"] == level
    flags.restore(before)
    assert flags.snapshot() == before and _legacy_view() == seen == ("highest", False, True)


@pytest.mark.parametrize("level", LEVELS)
def test_tf32lab_setters_and_scopes_keep_torchs_legacy_getter_truthful(level, user_flags):
    import tf32lab

    with tf32lab.precision(level):
        assert torch.get_float32_matmul_precision() == level
    assert _legacy_view() == ("highest", False, True)
    tf32lab.set_float32_matmul_precision(level)
    assert torch.get_float32_matmul_precision() == level
    assert torch.backends.cuda.matmul.allow_tf32 == (level != "highest")


@pytest.mark.skipif(flags.NEW_API, reason="the legacy API generation only (torch before 2.9)")
def test_the_legacy_api_is_read_written_and_restored_through_its_own_flags():
    before = flags.snapshot()
    assert flags.read_cell_table() == [] and flags.LEVEL_CELLS == ()
    assert [name for name, _ in flags.LEGACY_READERS] == [
        "torch.get_float32_matmul_precision()", "torch.backends.cuda.matmul.allow_tf32",
        "torch.backends.cudnn.allow_tf32"]
    torch.backends.cuda.matmul.allow_tf32 = True  # the legacy API's other name for 'high'
    assert flags.read_level() == "high" and flags.read_cells()["cuda.matmul"] == "tf32"
    torch.backends.cudnn.allow_tf32 = False
    cells = flags.read_cells()
    assert cells["cuda.conv"] == cells["cuda.rnn"] == "ieee" and cells["mkldnn.conv"] == "ieee"
    torch.set_float32_matmul_precision("medium")
    assert flags.read_cells()["mkldnn.matmul"] == "bf16"
    assert flags.read_level_state() == (("medium",), ("medium",))
    assert flags.level_values("high") == flags.level_raw("high") == ("high",)
    assert flags.effective_from_raw(("high",)) == ("high",) and flags.level_from_effective(("medium",)) == "medium"
    flags.write_level_raw(("highest",))
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32
    assert not torch.backends.cudnn.allow_tf32  # cuDNN's boolean is its own, apart from the level
    flags.restore(before)
    assert flags.snapshot() == before and torch.backends.cudnn.allow_tf32
