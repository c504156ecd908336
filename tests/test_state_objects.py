"""State a model keeps in a plain Python object it holds: the eval-mode cache of nflows' and normflows' LU
layers (``self.cache = _LinearCache()``, whose ``weight`` and ``inverse`` are set at the first call). The float64
reference would leave float64 tensors there for the float32 rows, which then raise at every level."""

from __future__ import annotations

import torch

import tf32lab
from tf32lab.measure.state import state_kept


class _Cache:
    """A weight made from the parameters at the first call in eval mode, as nflows' ``_LinearCache``."""

    def __init__(self) -> None:
        self.weight = None


class _CachedLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lower = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.upper = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.cache = _Cache()

    def forward(self, x):
        if self.cache.weight is None:
            self.cache.weight = self.lower.tril() @ self.upper.triu()
        return x @ self.cache.weight


def test_a_cache_in_a_plain_object_starts_empty_in_every_row_and_is_empty_again_afterwards():
    torch.manual_seed(0)
    model = _CachedLinear().eval()
    cache = model.cache
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(32, 16), name="cached"), levels=("highest", "high"),
                           target="a100", speed=False)
    highest, high = report.levels
    assert highest.error is None and high.error is None, (highest.error, high.error)
    # each row makes its own cache: its weight's product at the row's math (two GEMMs at each level)
    assert highest.outputs[0].normwise < 1e-5 < high.outputs[0].normwise < 1e-2
    assert sum(high.coverage.values()) == 2, high.coverage
    assert model.cache is cache and cache.weight is None
    assert any("cache.weight" in note for note in report.notes), report.notes


def test_reset_puts_back_a_plain_objects_data_attributes_and_leaves_its_code_alone():
    module = torch.nn.Linear(2, 2)
    module.cache = _Cache()
    module.cache.items = [1]
    with state_kept(module) as reset:
        module.cache.weight = torch.ones(2)
        module.cache.items.append(2)
        module.cache.fresh = 1
        module.cache.helper = print  # code, not state: left alone
        changed = reset()
        assert module.cache.weight is None and module.cache.items == [1] and not hasattr(module.cache, "fresh")
        assert module.cache.helper is print
    assert sorted(changed) == ["cache.fresh", "cache.items", "cache.weight"]
