"""``hf:FOLDER`` for each family a user keeps locally: tiny folders made here (configs with small sizes, tokenizers
trained on the sample sentences, processors saved from their classes), nothing downloaded."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

import cli_runner
import tf32lab
from tf32lab.errors import Tf32LabError
from tf32lab.workloads import hf, samples, specs

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# one worker runs this file, test_generation.py and test_generation_folders.py: their CLI runs fork from one server
# that has imported transformers (about 7 CPU seconds to start, once instead of on each worker), and the model
# folders they build for the session are built once
pytestmark = pytest.mark.xdist_group("hf_cli")


def _tokenizer(**special):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=_TEXT["vocab_size"], special_tokens=sorted(set(special.values())),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(samples.SENTENCES), trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special)


# a vocabulary large enough that a sample sentence is ~15 tokens: short inputs, fast checks
_TEXT = dict(vocab_size=1000)
_DECODER = dict(**_TEXT, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)


def _models():
    t = transformers
    return {
        # GPT-2's and Llama's tokenizers ship without a pad token: so do these
        "gpt2": (t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
                                                 eos_token_id=0, **_TEXT)),
                 dict(eos_token="<|endoftext|>", bos_token="<|endoftext|>")),
        "llama": (t.LlamaForCausalLM(t.LlamaConfig(**_DECODER)), dict(eos_token="</s>", bos_token="<s>")),
        "qwen2": (t.Qwen2ForCausalLM(t.Qwen2Config(**_DECODER)), dict(eos_token="<|endoftext|>")),
        "mistral": (t.MistralForCausalLM(t.MistralConfig(**_DECODER, sliding_window=16)),
                    dict(eos_token="</s>", bos_token="<s>")),
        # transformers' default experts run torch's grouped GEMM, which has no float64 kernel (the reference)
        "mixtral": (t.MixtralForCausalLM(t.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2)),
                    dict(eos_token="</s>", bos_token="<s>")),
        "bert": (t.BertModel(t.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=128, **_TEXT)),
                 dict(pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]")),
        "t5": (t.T5ForConditionalGeneration(t.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                                       decoder_start_token_id=0, pad_token_id=0, **_TEXT)),
               dict(pad_token="<pad>", eos_token="</s>")),
        "vit": (t.ViTForImageClassification(t.ViTConfig(image_size=32, patch_size=8, hidden_size=32,
                                                        num_hidden_layers=1, num_attention_heads=4,
                                                        intermediate_size=64, num_labels=5)), None),
        "convnext": (t.ConvNextModel(t.ConvNextConfig(image_size=32, num_stages=2, hidden_sizes=[8, 16],
                                                      depths=[1, 1])), None),
        "resnet": (t.ResNetModel(t.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                layer_type="basic")), None),
        "wav2vec2": (t.Wav2Vec2Model(t.Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                      intermediate_size=32, conv_dim=(8, 8), conv_kernel=(10, 3),
                                                      conv_stride=(5, 2), num_conv_pos_embeddings=16,
                                                      num_conv_pos_embedding_groups=2)), None),
        "whisper": (t.WhisperForConditionalGeneration(t.WhisperConfig(
            vocab_size=60, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8,
            max_source_positions=16, max_target_positions=16, decoder_start_token_id=1, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, suppress_tokens=None, begin_suppress_tokens=None)), None),
        # a text tower and an image tower: its main input is input_ids, yet it needs pixels as well
        "clip": (t.CLIPModel(t.CLIPConfig(
            text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             max_position_embeddings=64, **_TEXT),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                               image_size=16, patch_size=8), projection_dim=16)),
                 dict(eos_token="<|endoftext|>", bos_token="<|startoftext|>", pad_token="<|endoftext|>")),
        # a vision-language decoder: use_cache reaches its language model through **kwargs
        "llava": (t.LlavaForConditionalGeneration(t.LlavaConfig(
            text_config=t.LlamaConfig(**{**_DECODER, "vocab_size": 1010, "num_hidden_layers": 1}),
            vision_config=t.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, image_size=16, patch_size=8),
            image_token_index=1005)), dict(eos_token="</s>", bos_token="<s>")),
        # an image-to-text encoder-decoder: its image size is in its encoder's config
        "image to text": (t.VisionEncoderDecoderModel(t.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
            t.ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64),
            t.GPT2Config(n_embd=32, n_layer=1, n_head=4, add_cross_attention=True, is_decoder=True, **_TEXT),
            decoder_start_token_id=0, pad_token_id=0)), None),
    }


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    made = {}
    for name, (model, special) in _models().items():
        folder = root / name
        model.save_pretrained(folder)
        if special is not None:
            _tokenizer(**special).save_pretrained(folder)
        made[name] = folder
    # an image processor as saved from its class (written out: saving one needs Pillow, which may be absent);
    # where transformers can load it, it makes the pixels, else the config's size does: both 32x32 here
    (made["vit"] / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": 32, "width": 32},
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
        "rescale_factor": 1 / 255}))
    # a text model without its tokenizer, and a model type transformers does not know
    bare = root / "bert-no-tokenizer"
    transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                   intermediate_size=64)).save_pretrained(bare)
    made["bare"] = bare
    # a feature extractor's sampling rate makes "one second" of audio: 4000 samples here
    transformers.Wav2Vec2FeatureExtractor(sampling_rate=4000).save_pretrained(made["wav2vec2"])
    unknown = root / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "tf32lab-no-such-model"}))
    made["unknown"] = unknown
    # what a user's folder may lack or hold broken: weights, a tokenizer, a class transformers has, a processor
    llama = made["llama"]
    made["config only"] = root / "config only"
    transformers.AutoConfig.from_pretrained(str(llama)).save_pretrained(made["config only"])
    made["corrupt"] = root / "corrupt weights"
    shutil.copytree(llama, made["corrupt"])
    weights = (llama / "model.safetensors").read_bytes()
    (made["corrupt"] / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # a download cut short
    made["llama bare"] = root / "llama no tokenizer"
    made["llama bare"].mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(llama / name, made["llama bare"])
    made["own class"] = root / "own class"
    shutil.copytree(llama, made["own class"])
    config = json.loads((llama / "config.json").read_text())
    config.pop("dtype", None)  # as a hand-written config.json often is
    (made["own class"] / "config.json").write_text(json.dumps({**config, "architectures": ["MyLlamaForEverything"]}))
    made["vit odd processor"] = root / "vit odd processor"
    shutil.copytree(made["vit"], made["vit odd processor"])
    (made["vit odd processor"] / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "NoSuchImageProcessor"}))
    for name, text in (("empty config", "{}"), ("list config", "[]")):
        made[name] = root / name
        made[name].mkdir()
        (made[name] / "config.json").write_text(text)
    made["no architectures"] = root / "no architectures"
    shutil.copytree(made["bert"], made["no architectures"])
    config = json.loads((made["bert"] / "config.json").read_text())
    (made["no architectures"] / "config.json").write_text(json.dumps({**config, "architectures": None}))
    # weights that leave tensors to transformers' random initialization: a layer's MLP left out of the file, and a
    # config.json widened after the weights were saved (both were checked, exit 0, as if trained)
    from safetensors.torch import load_file, save_file

    made["partial"] = root / "llama partial weights"
    shutil.copytree(llama, made["partial"])
    kept = {k: v for k, v in load_file(llama / "model.safetensors").items() if ".layers.1.mlp." not in k}
    save_file(kept, made["partial"] / "model.safetensors", metadata={"format": "pt"})
    made["resized"] = root / "gpt2 resized config"
    shutil.copytree(made["gpt2"], made["resized"])
    config = json.loads((made["gpt2"] / "config.json").read_text())
    (made["resized"] / "config.json").write_text(json.dumps({**config, "n_embd": 48}))
    # a tokenizer's settings without the tokenizer itself (transformers' reasons follow its first line)
    made["tokenizer settings only"] = root / "llama tokenizer settings only"
    shutil.copytree(llama, made["tokenizer settings only"])
    (made["tokenizer settings only"] / "tokenizer.json").unlink()
    made["wav2vec2 bare"] = root / "wav2vec2 no extractor"
    made["wav2vec2 bare"].mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(made["wav2vec2"] / name, made["wav2vec2 bare"])
    return made


def _cli(*args):
    # forked from a server that has imported transformers, as every run here imports it
    return cli_runner.run("check", *args, timeout=300, preload=cli_runner.HF)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_check_on_a_decoder_folder_ends_with_a_verdict(folders, name):
    done = _cli(f"hf:{folders[name]}")
    assert done.returncode in (0, 1), done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    verdicts = [line for line in done.stdout.splitlines() if line.startswith(("PASSED |", "FAILED |"))]
    # logits compared, no cache object "compared exactly"
    assert verdicts and all("output 'logits'" in line for line in verdicts), verdicts
    assert any("PASSED | level 'highest'" in line for line in verdicts), verdicts
    assert "inputs: input_ids 16x" in " ".join(done.stdout.split())


@pytest.mark.parametrize("name, main", [
    ("qwen2", "input_ids"), ("mistral", "input_ids"), ("mixtral", "input_ids"), ("bert", "input_ids"),
    ("t5", "decoder_input_ids"),
    ("vit", "pixel_values"), ("convnext", "pixel_values"), ("resnet", "pixel_values"),
    ("wav2vec2", "input_values"), ("whisper", "input_features"),
])
def test_each_family_is_checked_with_every_op_emulated(folders, name, main):
    w = hf.workload(str(folders[name]), sentences=4)
    assert main in w.inputs and w.notes[0].startswith("inputs: ")
    assert w.inputs[main].size(0) == 4
    report = tf32lab.check(w, levels=("highest", "high"), speed=False)
    for row in report.levels:
        assert row.error is None and row.unhandled == {}, (row.level, row.error, row.unhandled)
        assert all(o.failure is None for o in row.outputs), [o.failure for o in row.outputs]
    assert report.level("highest").passed
    assert w.notes[0] in report.notes


def test_the_inputs_follow_the_folder(folders):
    vit = hf.workload(str(folders["vit"]), sentences=2)
    assert tuple(vit.inputs["pixel_values"].shape) == (2, 3, 32, 32)
    resnet = hf.workload(str(folders["resnet"]), sentences=2)  # no image size in its config: 224
    assert tuple(resnet.inputs["pixel_values"].shape) == (2, 3, 224, 224)
    whisper = hf.workload(str(folders["whisper"]), sentences=2)  # 2 * max_source_positions frames
    assert tuple(whisper.inputs["input_features"].shape) == (2, 8, 32)
    wav2vec2 = hf.workload(str(folders["wav2vec2"]), sentences=2)  # one second at its extractor's rate
    assert tuple(wav2vec2.inputs["input_values"].shape) == (2, 4000) and "feature extractor" in wav2vec2.notes[0]
    t5 = hf.workload(str(folders["t5"]), sentences=2)
    ids, decoder = t5.inputs["input_ids"], t5.inputs["decoder_input_ids"]
    assert torch.equal(decoder[:, 1:], ids[:, :-1]) and bool((decoder[:, 0] == 0).all())
    gpt2 = hf.workload(str(folders["gpt2"]), sentences=3)
    assert gpt2.inputs["use_cache"] is False and set(gpt2.inputs) == {"input_ids", "attention_mask", "use_cache"}
    logging = transformers.utils.logging
    before = logging.get_verbosity(), logging.is_progress_bar_enabled()
    again = hf.workload(str(folders["resnet"]), sentences=2)  # seeded
    assert torch.equal(again.inputs["pixel_values"], resnet.inputs["pixel_values"])
    assert (logging.get_verbosity(), logging.is_progress_bar_enabled()) == before  # loading quietly, put back


def test_what_is_not_supported_is_one_line_and_exit_2(folders):
    with pytest.raises(Tf32LabError, match=r"a text model \(model type 'bert'\) with no tokenizer in .*save one"):
        specs.load(f"hf:{folders['bare']}")  # not an empty-vocabulary tokenizer, silently
    with pytest.raises(Tf32LabError, match="model type 'tf32lab-no-such-model' is unknown"):
        specs.load(f"hf:{folders['unknown']}")
    done = _cli(f"hf:{folders['unknown']}", "--levels", "high")
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, lines
    assert "model type 'tf32lab-no-such-model' is unknown to this transformers; supported: " in lines[0]
    assert "decoders (GPT-2, Llama" in lines[0]


def test_an_empty_folder_is_refused_not_the_working_directory(folders, monkeypatch):
    monkeypatch.chdir(folders["gpt2"])  # a model folder as the working directory: "hf:" must not mean it
    for spec in ("hf:", "hf:  "):
        with pytest.raises(Tf32LabError, match=r"workload 'hf:\s*': no folder given; accepted: hf:FOLDER"):
            specs.load(spec)


def test_a_path_near_a_model_folder_says_where_the_folder_is(folders, tmp_path):
    cache = tmp_path / "models--someone--llama"  # the Hugging Face cache's layout
    shutil.copytree(folders["llama"], cache / "snapshots" / "0123abc")
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "llama-q4.gguf").write_bytes(b"GGUF")
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    for spec, line in ((cache, r"a Hugging Face cache folder: give a snapshot in it, such as hf:.*snapshots/0123abc$"),
                       (folders["llama"] / "model.safetensors", r"model\.safetensors is a file: give the folder"),
                       (tmp_path / "gguf", r"llama-q4\.gguf is a GGUF file \(llama\.cpp's format\)"),
                       (tmp_path / "lora", r"a PEFT adapter \(adapter_config\.json\): merge it into its base model")):
        with pytest.raises(Tf32LabError, match=line):
            specs.load(f"hf:{spec}")


def test_the_working_directory_as_folder_is_named_as_itself(folders, monkeypatch):
    monkeypatch.chdir(folders["llama"])
    assert hf.workload(".", sentences=2).name == "llama"  # the report's header read "tf32lab check " before
    monkeypatch.chdir(folders["llama"] / "..")
    assert hf.causal_lm("llama/").name == "llama"


def test_a_folder_with_its_own_code_is_refused_and_its_code_not_run(tmp_path):
    folder, marker = tmp_path / "remote", tmp_path / "ran"
    folder.mkdir()
    (folder / "modeling_mine.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "mine", "architectures": ["MineModel"],
        "auto_map": {"AutoConfig": "modeling_mine.MineConfig", "AutoModel": "modeling_mine.MineModel"}}))
    with pytest.raises(Tf32LabError, match=r"names the folder's own code \(auto_map\), which tf32lab never runs; "
                                           r"supported: "):
        specs.load(f"hf:{folder}")
    assert not marker.exists()


def test_a_sentence_transformers_folder_is_checked_on_its_embeddings(folders, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer import modules as models
    folder = tmp_path / "st model"
    modules = [models.Transformer(str(folders["bert"])), models.Pooling(32), models.Normalize()]
    st.SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    w = hf.workload(str(folder), sentences=4)
    assert set(w.run()) == {"sentence_embedding"}  # what its user reads: not BERT's unused pooler
    assert w.inputs["input_ids"].size(0) == 4 and "sentence-transformers" in w.notes[0]
    report = tf32lab.check(w, levels=("high",), speed=False)
    row = report.level("high")
    assert row.error is None and row.unhandled == {} and [o.name for o in row.outputs] == ["sentence_embedding"]


def test_a_tokenizer_without_pad_or_end_tokens_pads_all_the_same(folders, tmp_path):
    folder = tmp_path / "no special tokens"
    transformers.LlamaForCausalLM.from_pretrained(str(folders["llama"])).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)  # no pad, end-of-sequence, start or unknown token
    w = hf.workload(str(folder), sentences=3)
    ids, mask = w.inputs["input_ids"], w.inputs["attention_mask"]
    assert ids.size(0) == 3 and not bool(mask.all())  # padded, the mask hiding the padding
    assert hf.causal_lm(str(folder)).tokenizer.pad_token is not None


def test_half_precision_weights_are_checked_in_float32_and_say_so(folders, tmp_path):
    folder = tmp_path / "bf16"
    model = transformers.LlamaForCausalLM.from_pretrained(str(folders["llama"]))
    model.to(torch.bfloat16).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(folders["llama"])).save_pretrained(folder)
    w = hf.workload(str(folder), sentences=2)
    assert next(w.model.parameters()).dtype == torch.float32
    assert "weights saved as bfloat16, checked in float32" in w.notes[0]
    assert "saved as" not in hf.workload(str(folders["llama"]), sentences=2).notes[0]


def test_the_sentences_are_cut_to_the_models_context(folders, tmp_path):
    folder = tmp_path / "short context"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, n_positions=8, **_TEXT)
                                 ).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(folders["gpt2"])).save_pretrained(folder)
    w = hf.workload(str(folder), sentences=2)
    assert w.inputs["input_ids"].size(1) == 8  # the sentences are longer: an index error past position 8 before
    row = tf32lab.check(w, levels=("high",), speed=False).level("high")
    assert row.error is None and row.unhandled == {}


def test_a_text_image_model_gets_sentences_and_images(folders):
    w = hf.workload(str(folders["clip"]), sentences=4)  # it raised on pixel_values None at the reference before
    assert w.inputs["input_ids"].size(0) == 4 and tuple(w.inputs["pixel_values"].shape) == (4, 3, 16, 16)
    assert "pixel_values 4x3x16x16" in w.notes[0]
    report = tf32lab.check(w, levels=("highest", "high"), speed=False)
    for row in report.levels:
        assert row.error is None and row.unhandled == {}, (row.level, row.error, row.unhandled)
    assert {"logits_per_image", "text_embeds", "image_embeds"} <= {o.name for o in report.level("high").outputs}
    assert report.level("highest").passed


@pytest.mark.parametrize("name, args, line", [
    ("config only", (), r"no weights in .*config only \(found: config\.json\); accepted: model\.safetensors, "),
    ("corrupt", (), r"its weights could not be read \(a truncated or corrupt file\?\): SafetensorError: "),
    ("corrupt", ("--generate", "4"), r"its weights could not be read \(a truncated or corrupt file\?\)"),
    ("llama bare", ("--generate", "4"), r"a text model \(model type 'llama'\) with no tokenizer in .*save one"),
    ("empty config", (), r"its config\.json has no model_type \(its keys: none\); accepted: a config\.json as "
                         r"save_pretrained writes it"),
    ("list config", (), r"its config\.json is a JSON list, not an object; accepted: "),
    # --generate on what is not a decoder-only causal LM: BART's decoder alone was decoded, exit 0
    ("t5", ("--generate", "4"), r"model type 't5' is an encoder-decoder; the generation check decodes a "
                                r"decoder-only causal language model \(GPT-2, .*check it without --generate"),
    ("vit", ("--generate", "4"), r"model type 'vit' is not a causal language model; "),  # was: "with no tokenizer"
    ("bert", ("--generate", "4"), r"model type 'bert' is saved as BertModel, not a causal language model; "),
    *[("partial", args, r"its weights lack 3 of the model's tensors \(model\.layers\.1\.mlp\.down_proj\.weight, "
                        r"model\.layers\.1\.mlp\.gate_proj\.weight, model\.layers\.1\.mlp\.up_proj\.weight\), "
                        r"which transformers would make at random") for args in ((), ("--generate", "4"))],
    *[("resized", args, r"its weights do not fit its config\.json: \d+ tensors were saved in another shape "
                        r"\(transformer\.h\.0\.attn\.c_attn\.bias: saved \(96,\), config\.json makes \(144,\)\)")
      for args in ((), ("--generate", "4"))],
    # transformers' reasons, after a line that ends in a colon: were cut at "from one of:"
    ("tokenizer settings only", ("--generate", "4"), r"loading its tokenizer failed: ValueError: Couldn't "
                                                     r"instantiate the backend tokenizer from one of: \(1\) "),
])
def test_what_a_folder_lacks_is_one_line(folders, name, args, line):
    load = hf.causal_lm if args else hf.workload  # what check and check --generate load
    with pytest.raises(Tf32LabError, match=line) as raised:
        load(str(folders[name]))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("name, args", [("config only", ()), ("t5", ("--generate", "4")),
                                        ("partial", ("--generate", "4")), ("resized", ())])
def test_what_a_folder_lacks_is_exit_2_on_the_command_line(folders, name, args):
    done = _cli(f"hf:{folders[name]}", "--levels", "high", *args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith(f"tf32lab check: error: workload 'hf:{folders[name]}': "), lines[0]


def test_a_class_transformers_lacks_is_checked_as_automodel_and_said(folders):
    done = _cli(f"hf:{folders['own class']}", "--levels", "high")
    assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stderr[-2000:]
    out = " ".join(done.stdout.split())
    assert "its config names MyLlamaForEverything, a class this transformers does not have: checked as " \
           "LlamaModel (AutoModel)" in out, out[-2000:]
    assert "deprecated" not in done.stderr, done.stderr  # no line of transformers' from reading the config


def test_a_processor_not_used_is_named_and_no_warning_on_the_way(folders):
    vit = hf.workload(str(folders["vit odd processor"]), sentences=2)
    assert tuple(vit.inputs["pixel_values"].shape) == (2, 3, 32, 32)
    assert "seeded normalized pixels of the config's size; its image processor not used: " in vit.notes[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a list of arrays made into a tensor warned "extremely slow"
        audio = hf.workload(str(folders["wav2vec2 bare"]), sentences=2)
    assert tuple(audio.inputs["input_values"].shape) == (2, 16000)
    assert "one second of seeded noise at 16 kHz" in audio.notes[0]


def test_a_vision_language_decoder_is_checked_on_its_logits_and_says_what_it_was_fed(folders):
    w = hf.workload(str(folders["llava"]), sentences=2)
    assert w.inputs["use_cache"] is False and "pixel_values" not in w.inputs
    assert "no images: they go at image tokens the sentences do not have" in w.notes[0]
    row = tf32lab.check(w, levels=("highest",), speed=False).level("highest")
    # its cache was an output, compared exactly: "differs" at highest
    assert row.error is None and [o.name for o in row.outputs] == ["logits"] and row.passed


def test_an_image_to_text_model_gets_images_of_its_encoders_size(folders):
    w = hf.workload(str(folders["image to text"]), sentences=2)
    assert tuple(w.inputs["pixel_values"].shape) == (2, 3, 16, 16)  # 224 raised "doesn't match model (16*16)"
    row = tf32lab.check(w, levels=("high",), speed=False).level("high")
    assert row.error is None and row.unhandled == {}


def test_a_config_naming_no_architectures_is_said(folders):
    w = hf.workload(str(folders["no architectures"]), sentences=2)
    assert "its config names no architectures: checked as BertModel (AutoModel), without a head" in w.notes
