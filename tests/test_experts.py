"""``experts_eager`` on mixtures of experts that are not one transformers model with one implementation: a model
held by the user's own module, a model of several submodels whose experts run otherwise than the top one's, and
implementations put back as each submodel had its own."""

from __future__ import annotations

import pytest
import torch

import tf32lab
from tf32lab.workloads.experts import experts_eager

transformers = pytest.importorskip("transformers")

SIZE = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16)


def _mixtral() -> torch.nn.Module:
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**SIZE, num_local_experts=4,
                                                                      num_experts_per_tok=2))


def _vision_language() -> torch.nn.Module:
    # experts in the text submodel only, under a top-level config of their own
    text = dict(SIZE, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  deepstack_visual_indexes=[])
    return transformers.Qwen3VLMoeForConditionalGeneration(
        transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision))


def _implementations(model: torch.nn.Module) -> list[str]:
    return [m.config._experts_implementation for m in model.modules()
            if isinstance(m, transformers.PreTrainedModel)]


class Logits(torch.nn.Module):
    """The user's own module around a transformers model, as a Workload often holds one."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, use_cache=False).logits


def test_a_mixture_of_experts_held_by_a_module_of_the_users_is_checked_in_float64():
    # the switch looked at the workload's model alone: a transformers model inside it kept its grouped GEMM, which
    # has no float64 kernel, and the float64 reference refused valid input
    torch.manual_seed(0)
    wrapped = Logits(_mixtral())
    assert wrapped.inner.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 64, (2, 8))
    report = tf32lab.check(tf32lab.Workload(wrapped, ids), levels=("highest",), target="a100", speed=False)
    assert report.level("highest").error is None and report.level("highest").passed
    assert wrapped.inner.config._experts_implementation == "grouped_mm"


def test_submodels_experts_run_eager_when_the_top_config_is_eager_already():
    model = _vision_language()
    model.set_experts_implementation({"": "eager", "text_config": "grouped_mm"})
    before = _implementations(model)
    assert "grouped_mm" in before
    with experts_eager(model):
        assert set(_implementations(model)) == {"eager"}
    assert _implementations(model) == before


def test_each_submodels_own_implementation_is_put_back():
    # put back as one string, the top config's, every submodel got it: the text model's batched GEMM became grouped
    model = _vision_language()
    model.set_experts_implementation({"": "grouped_mm", "text_config": "batched_mm"})
    before = _implementations(model)
    assert "batched_mm" in before
    with experts_eager(model):
        assert set(_implementations(model)) == {"eager"}
    assert _implementations(model) == before
    with pytest.raises(KeyError), experts_eager(model):  # on every exit
        raise KeyError("x")
    assert _implementations(model) == before


def test_a_mixture_of_experts_is_tuned_in_float64():
    # as check: tune's float64 reference ran the grouped GEMM, which has no float64 kernel, and refused valid input
    torch.manual_seed(0)
    wrapped = Logits(_mixtral())
    tuning = tf32lab.tune(tf32lab.Workload(wrapped, torch.randint(0, 64, (2, 8))), tolerance=0.1)
    assert tuning.passed and tuning.report.level("highest").error is None
    assert wrapped.inner.config._experts_implementation == "grouped_mm"
