"""``hf:FOLDER`` on what users' folders hold beyond GPT-2, Llama and BERT: a tokenizer whose pad token the model
cannot embed, a tokenizer of more ids than the model, a spectrogram transformer's inputs. Each folder is the
smallest that shows it, made in the test."""

from __future__ import annotations

import pytest
import torch

import hf_builders
import tf32lab
from tf32lab.errors import Tf32LabError
from tf32lab.workloads import hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def test_a_pad_token_past_the_embedding_pads_with_one_it_has(tmp_path):
    # a pad token added to the tokenizer without resizing the model (transformers 5 also gives a Qwen2 folder's
    # tokenizer a pad token of its own past the vocabulary): masked out, yet it went through the embedding
    tok = hf_builders.tokenizer(added=("[PAD]",), eos_token="</s>", bos_token="<s>")
    tok.pad_token = "[PAD]"
    assert tok.pad_token_id == hf_builders.VOCAB
    folder = hf_builders.folder(tmp_path / "llama", hf_builders.llama(), tok)
    w = hf.workload(str(folder), sentences=3)
    assert int(w.inputs["input_ids"].max()) < hf_builders.VOCAB
    report = tf32lab.check(w, levels=("highest",), speed=False)
    row = report.level("highest")
    assert row.error is None and row.passed and row.unhandled == {}, (row.error, row.unhandled)
    generated = tf32lab.check_generation(hf.causal_lm(str(folder)), new_tokens=2, levels=("highest",),
                                         prompts=["the cat", "a model of the sky is"])
    assert generated.floor.failure is None and len(generated.reference_tokens[0]) == 2


def test_a_tokenizer_of_more_ids_than_the_model_is_one_line(tmp_path):
    folder = hf_builders.folder(tmp_path / "llama", hf_builders.llama(vocab=120),
                                hf_builders.tokenizer(eos_token="</s>"))
    with pytest.raises(Tf32LabError, match=r"its tokenizer gives token id \d+, past the model's 120 input "
                                           r"embeddings: a tokenizer of another model"):
        hf.workload(str(folder), sentences=2)


def test_a_spectrogram_transformer_gets_frames_by_bins_without_its_extractor(tmp_path):
    torch.manual_seed(0)
    config = transformers.ASTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    intermediate_size=64, num_mel_bins=16, max_length=32, patch_size=8)
    folder = hf_builders.folder(tmp_path / "ast", transformers.ASTForAudioClassification(config))
    w = hf.workload(str(folder), sentences=2)
    assert tuple(w.inputs["input_values"].shape) == (2, 32, 16)  # a waveform raised "Dimension out of range"
    assert w.notes[0].startswith("inputs: input_values 2x32x16 (seeded filter-bank-like features")
    row = tf32lab.check(w, levels=("highest",), speed=False).level("highest")
    assert row.error is None and row.passed and row.unhandled == {}, (row.error, row.unhandled)


def test_a_prompt_past_a_decoders_positions_is_named():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                                                 n_positions=32))
    # 30 tokens and 4 new ones: GPT-2's position table ends at 32 ("index out of range in self" said no more)
    with pytest.raises(Tf32LabError, match=r"prompt 1 \(30 tokens, the longest\) and 4 new tokens need 33 "
                                           r"positions; model 'GPT2LMHeadModel' has 32 \(config.n_positions\)"):
        tf32lab.check_generation(gpt2, new_tokens=4, levels=("highest",), prompts=[list(range(30)), [1, 2]])
    report = tf32lab.check_generation(gpt2, new_tokens=4, levels=("highest",), prompts=[list(range(28))])
    assert report.floor.failure is None  # 28 + 4 fit


def _decoders():
    t = transformers
    size = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    return {
        # a window of 4 on prompts of 10 and 7 tokens (Gemma2's first layer slides too): the cache drops keys that
        # the full sequence masks out
        "mistral sliding window": lambda: t.MistralForCausalLM(t.MistralConfig(**size, sliding_window=4)),
        "gemma2 soft-capping": lambda: t.Gemma2ForCausalLM(t.Gemma2Config(
            **size, head_dim=8, sliding_window=4, attn_logit_softcapping=20.0, final_logit_softcapping=10.0)),
        "phi partial rotary": lambda: t.PhiForCausalLM(t.PhiConfig(**size, partial_rotary_factor=0.5)),
        # a state-space decoder multiplies the tokens fed by the mask: the whole sequence's beside one cached token
        # broadcast it to every position, and its cached tokens left the full sequence's at the third
        "mamba state space": lambda: t.MambaForCausalLM(t.MambaConfig(
            vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, initializer_range=0.5)),
        # a state-space layer then an attention layer with two experts (at the default initializer range every prompt
        # decoded the same tokens, and a mask or a cache that went wrong changed none)
        "jamba hybrid": lambda: t.JambaForCausalLM(t.JambaConfig(
            **{**size, "num_hidden_layers": 2}, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_dt_rank=4,
            initializer_range=0.5)),
        "mixtral experts": lambda: t.MixtralForCausalLM(t.MixtralConfig(**size, num_local_experts=4,
                                                                         num_experts_per_tok=2)),
        # a recurrent block whose temporal convolution takes no mask: left padding reached a short prompt's tokens
        "recurrentgemma recurrent block": lambda: _widened(t.RecurrentGemmaForCausalLM(t.RecurrentGemmaConfig(
            **{**size, "num_key_value_heads": 1, "num_hidden_layers": 2}, lru_width=32, attention_window_size=8,
            block_types=["recurrent", "attention"])).float()),  # .float(): its normalizer buffer is bfloat16
        # a linear-attention layer first: the cache's length is its first layer's, none, and a padded prompt's
        # cached steps built the full-attention layer's mask as if at position 0
        "minimax linear attention": lambda: _widened(t.MiniMaxForCausalLM(t.MiniMaxConfig(
            **{**size, "num_hidden_layers": 2}, head_dim=8, layer_types=["linear_attention", "full_attention"],
            block_size=4, num_local_experts=2, num_experts_per_tok=1))),
    }


def _widened(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its matrices drawn wider than its initializer's (a pad token's embedding among them): at
    RecurrentGemma's own every prompt decoded one token over and over, padded or not."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("name", list(_decoders()))
def test_the_cache_on_or_off_decodes_the_same_tokens(name):
    torch.manual_seed(0)
    model = _decoders()[name]()
    prompts = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7], [2, 7, 18, 28, 18, 28, 4]]
    # natively: the rows' maths are not the question, what the cache changes is
    on, off = (tf32lab.check_generation(model, new_tokens=6, levels=("highest",), prompts=prompts, use_cache=cache,
                                        target="native") for cache in (True, False))
    assert on.use_cache and not off.use_cache
    assert on.reference_tokens == off.reference_tokens and len(on.reference_tokens[0]) == 6
    for a, b in ((on.floor, off.floor), (on.level("highest"), off.level("highest"))):
        assert a.failure is None and b.failure is None and a.unhandled == {} == b.unhandled, (a.failure, b.failure)
        assert a.divergence == b.divergence and a.agreement == b.agreement


@pytest.mark.parametrize("name", list(_decoders()))
def test_prompts_batched_or_alone_decode_the_same_tokens(name):
    # the prompts are decoded as one left-padded batch: the padding must change no prompt's tokens (its positions
    # count from its own first token, the mask hides the padding from attention and from a state-space mixer)
    torch.manual_seed(0)
    model = _decoders()[name]()
    prompts = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7], [2, 7, 18, 28, 18, 28, 4]]
    batched = tf32lab.check_generation(model, new_tokens=6, levels=("highest",), prompts=prompts, target="native")
    alone = [tf32lab.check_generation(model, new_tokens=6, levels=("highest",), prompts=[p],
                                      target="native").reference_tokens[0] for p in prompts]
    assert batched.reference_tokens == tuple(alone)
    assert len(set(alone)) == 2  # prompts that decode alike would hide padding that leaks


def test_a_mixture_of_experts_built_in_python_decodes_in_float64_and_keeps_its_experts_implementation():
    # transformers 5 runs experts by torch._grouped_mm, which has no float64 kernel: a model not loaded from a folder
    # (loading asks for "eager") was refused at the float64 reference, "Expected mat_a to be Float32..."
    torch.manual_seed(0)
    model = _decoders()["jamba hybrid"]()
    assert model.config._experts_implementation == "grouped_mm"
    report = tf32lab.check_generation(model, new_tokens=3, levels=("highest",), prompts=[[3, 14, 15, 9]],
                                      target="native")
    assert report.floor.failure is None and len(report.reference_tokens[0]) == 3
    assert model.config._experts_implementation == "grouped_mm"  # the caller's model as it was


def test_a_mixture_of_experts_built_in_python_is_checked_and_trained_in_float64():
    # the same grouped GEMM stopped check() and check_training() at their float64 rows, a refusal of valid input
    torch.manual_seed(0)
    model = _decoders()["mixtral experts"]()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    report = tf32lab.check(tf32lab.Workload(model, {"input_ids": ids, "use_cache": False}),
                           levels=("highest", "high"), target="a100", speed=False)
    assert report.level("highest").passed and report.level("high").error is None
    assert model.config._experts_implementation == "grouped_mm"
    training = tf32lab.TrainingWorkload(model, [ids, ids], loss=lambda out, b: out.logits.float().square().mean(),
                                        inputs=lambda b: {"input_ids": b, "use_cache": False},
                                        optimizer=lambda p: torch.optim.SGD(p, lr=1e-2))
    trained = tf32lab.check_training(training, levels=("highest",), target="native", speed=False)
    assert trained.floor.failure is None and trained.passed
    assert model.config._experts_implementation == "grouped_mm"


def test_a_model_that_reads_its_hidden_states_runs_at_every_level(tmp_path):
    # transformers 5 captures hidden states through hooks it installs at the first call, marking the model; the
    # check put the mark back between runs, the hooks were installed again and each stage captured twice
    torch.manual_seed(0)
    config = transformers.SegformerConfig(image_size=32, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                          hidden_sizes=[8, 16], num_attention_heads=[1, 2], decoder_hidden_size=16,
                                          num_labels=3)
    folder = hf_builders.folder(tmp_path / "segformer", transformers.SegformerForSemanticSegmentation(config))
    report = tf32lab.check(hf.workload(str(folder), sentences=2), levels=("highest", "high"), speed=False)
    for row in report.levels:
        assert row.error is None and row.unhandled == {}, (row.level, row.error, row.unhandled)
    assert report.level("highest").passed
    assert not any("keeps state" in note for note in report.notes), report.notes


def test_a_model_that_reads_its_hidden_states_runs_at_every_level_through_the_python_api():
    # not loaded from a folder, so not prepared: the hooks a run installs are removed with the mark it leaves
    torch.manual_seed(0)
    config = transformers.SegformerConfig(image_size=32, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                          hidden_sizes=[8, 16], num_attention_heads=[1, 2], decoder_hidden_size=16,
                                          num_labels=3)
    model = transformers.SegformerForSemanticSegmentation(config).eval()
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    report = tf32lab.check(tf32lab.Workload(model, {"pixel_values": torch.randn(2, 3, 32, 32)}, name="segformer"),
                           levels=("highest", "high"), speed=False)
    for row in report.levels:
        assert row.error is None and row.passed, (row.level, row.error)
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == hooks


def test_a_mask_made_from_the_widened_dtypes_limit_runs_in_float64(tmp_path):
    # XGLM masks with torch.full((), torch.finfo(weights.dtype).min) and no dtype: float64's least value, made
    # at float32's default, overflowed, and the reference raised before any level ran
    torch.manual_seed(0)
    config = transformers.XGLMConfig(vocab_size=hf_builders.VOCAB, d_model=16, num_layers=1, attention_heads=2,
                                     ffn_dim=32, max_position_embeddings=128)
    folder = hf_builders.folder(tmp_path / "xglm", transformers.XGLMForCausalLM(config),
                                hf_builders.tokenizer(pad_token="<pad>", eos_token="</s>"))
    row = tf32lab.check(hf.workload(str(folder), sentences=2), levels=("highest",), speed=False).level("highest")
    assert row.error is None and row.passed and row.unhandled == {}, (row.error, row.unhandled)


def test_a_speech_to_text_model_gets_frames_of_its_filter_banks_without_its_extractor(tmp_path):
    torch.manual_seed(0)
    config = transformers.Speech2TextConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                            decoder_ffn_dim=32, input_feat_per_channel=8, conv_channels=8,
                                            max_source_positions=16, max_target_positions=16)
    folder = hf_builders.folder(tmp_path / "s2t", transformers.Speech2TextForConditionalGeneration(config))
    w = hf.workload(str(folder), sentences=2)  # was refused: "takes input_features but ... no feature extractor"
    assert tuple(w.inputs["input_features"].shape) == (2, 32, 8)  # frames by filter banks, within its positions
    row = tf32lab.check(w, levels=("highest",), speed=False).level("highest")
    assert row.error is None and row.passed and row.unhandled == {}, (row.error, row.unhandled)


def test_a_decoder_that_returns_no_cache_is_said_to_run_the_whole_sequence_and_no_deprecation_is_logged():
    # RecurrentGemma keeps its state in its modules and returns no cache: every step ran the whole sequence, and
    # reading the output's past_key_values for one logged transformers 5's deprecation of that name, once a process
    import logging

    from transformers.utils import logging as hf_logging

    model = _decoders()["recurrentgemma recurrent block"]()
    said: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler, logger = Kept(), logging.getLogger("transformers")
    hf_logging.warning_once.cache_clear()  # a warning another test logged is logged again
    logger.addHandler(handler)
    try:
        report = tf32lab.check_generation(model, new_tokens=2, levels=("highest",), prompts=[[3, 14, 15]],
                                          target="native")
    finally:
        logger.removeHandler(handler)
    assert not [line for line in said if "deprecated" in line], said
    assert any("takes no key/value cache: every step ran the whole sequence" in note for note in report.notes), \
        report.notes
