"""Models from a local Hugging Face folder (``hf:FOLDER``): nothing is downloaded.

:func:`workload` is what ``tf32lab check hf:FOLDER`` measures: the model class the folder's ``config.json`` names
(``architectures``, else ``AutoModel``), fed sample inputs of the kind its main input is:

- ``input_ids`` (encoders, decoders): the built-in sample sentences through the folder's tokenizer, padded (a
  tokenizer shipped without a pad token, as GPT-2's and Llama's are, pads with its end-of-sequence token, else
  another special token, else its first vocabulary entry);
- ``pixel_values`` (ViT, ConvNeXt, ResNet, ...): seeded random images through the folder's image processor, or,
  without one, seeded normalized pixels of the config's ``num_channels`` and ``image_size`` (224 if it has none);
- ``input_values`` (wav2vec2, HuBERT, ...): one second of seeded noise at 16 kHz, through the folder's feature
  extractor if it has one; a spectrogram transformer's (AST: a config with ``num_mel_bins`` and ``max_length``)
  are seeded filter-bank-like frames, ``max_length`` by ``num_mel_bins``;
- ``input_features`` (Whisper): log-mel-like seeded features of the config's ``num_mel_bins`` and
  ``2 * max_source_positions`` frames, or the folder's feature extractor on 30 seconds of noise; Speech2Text's
  are frames (up to 400) by its ``input_feat_per_channel`` filter banks.

A text-image model (CLIP, SigLIP) gets the sentences and seeded images; a vision-language decoder (LLaVA) its text
path only, as its note says. What a folder lacks (weights, readable weights, every tensor of the model, a tokenizer, a
``model_type``) is one line naming what is there.

A sentence-transformers folder (``modules.json``) runs its whole pipeline and is compared on ``sentence_embedding``,
as ``minilm`` is. An encoder-decoder (T5, BART, Whisper) also gets ``decoder_input_ids``: the text's ids shifted
right behind the decoder's start token (seeded ids for audio). A model that takes a cache runs with
``use_cache=False``: the check compares what the forward pass computes (logits, hidden states), not a cache that is
the next step's input (the generation check measures decoding with the cache). The inputs' names and shapes are a
note of the report.

:func:`causal_lm` gives a decoder and its tokenizer, padding on the left, for the generation check.

Example:

    >>> from tf32lab.workloads import hf
    >>> try:
    ...     hf.workload("/no/such/folder")
    ... except Exception as exc:
    ...     print(str(exc).split(": ", 1)[1])
    no folder /no/such/folder (accepted: hf:FOLDER, a local transformers model folder with its config.json and weights)
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from tf32lab.errors import Tf32LabError
from tf32lab.workloads import samples
from tf32lab.workloads.quiet import quiet_loading
from tf32lab.workloads.workload import Workload

__all__ = ["SUPPORTED", "CausalLM", "causal_lm", "embedding_rows", "workload"]

SUPPORTED = ("text encoders (BERT-like), decoders (GPT-2, Llama, Qwen2, Mistral), encoder-decoders (T5, BART), "
             "vision (ViT, ConvNeXt, ResNet), text-image (CLIP, SigLIP) and audio (wav2vec2, Whisper) models: a main "
             "input of input_ids, pixel_values, input_values or input_features")

# The files a saved tokenizer leaves; without any, transformers builds an empty-vocabulary tokenizer silently
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                    "tokenizer.model", "sentencepiece.bpe.model", "merges.txt")
# what save_pretrained writes (or a sharded index of it): transformers 5 reads no TensorFlow or Flax weights
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_SEED = 0
_IMAGES = 4  # at most this many images or audio clips: a batch of 4 already fills a vision model's GEMMs
_RATE = 16_000  # audio models' usual sampling rate, when no feature extractor says otherwise


@dataclass
class CausalLM:
    """A causal language model (float32, eval mode) and its tokenizer (a pad token set), from ``hf:FOLDER``."""

    model: torch.nn.Module
    tokenizer: Any
    name: str
    notes: tuple[str, ...] = ()  # what the report says of the folder (weights saved in another dtype)


def _looks_like_hub_id(text: str) -> bool:
    """Whether ``text`` reads as a Hugging Face Hub id (``name`` or ``owner/name``) rather than a path."""
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", text)) and not text.endswith((".", "-"))


def _near_miss(path: Path) -> str:
    """What a path without a config.json is instead, where a user's folder often is: a file in the model's folder,
    a PEFT adapter, the Hugging Face cache's folder of a model (its snapshots hold the files), llama.cpp's GGUF
    files."""
    if path.is_file():
        return f"; {path.name} is a file: give the folder that holds it and its config.json"
    if (path / "adapter_config.json").is_file():
        return ("; a PEFT adapter (adapter_config.json): merge it into its base model (merge_and_unload, then "
                "save_pretrained) and give that folder")
    try:
        snapshots = sorted(p for p in (path / "snapshots").glob("*") if (p / "config.json").is_file())
        gguf = sorted(p.name for p in path.glob("*.gguf"))
    except OSError:  # unreadable: the line without a hint
        return ""
    if snapshots:
        return f"; a Hugging Face cache folder: give a snapshot in it, such as hf:{snapshots[-1]}"
    if gguf:
        return (f"; {gguf[0]} is a GGUF file (llama.cpp's format), which transformers does not load here: give the "
                f"model's transformers folder (config.json and safetensors)")
    return ""


def _folder(folder: str) -> Path:
    if not folder.strip():  # Path("") is the working directory: a model there would load unasked
        raise Tf32LabError(f"workload 'hf:{folder}': no folder given; accepted: hf:FOLDER, a local transformers "
                           f"model folder (its config.json and weights)")
    path = Path(folder).expanduser()
    if (path / "config.json").is_file():
        return path
    if not path.exists():  # "no config.json in" a folder that is not there sent users looking inside it
        accepted = "accepted: hf:FOLDER, a local transformers model folder with its config.json and weights"
        hub = "" if not _looks_like_hub_id(folder) else (
            f"; for a Hugging Face Hub id, download it once (`huggingface-cli download {folder} --local-dir DIR`, "
            f"or `huggingface_hub.snapshot_download({folder!r}, local_dir=DIR)`) and pass hf:DIR: nothing is "
            f"downloaded at run time")
        raise Tf32LabError(f"workload 'hf:{folder}': no folder {path} ({accepted}){hub}")
    raise Tf32LabError(f"workload 'hf:{folder}': no config.json in {path} (a local transformers model "
                       f"folder){_near_miss(path)}")


def _name(path: Path) -> str:
    """The folder's own name, also for ``hf:.`` or ``hf:..``, whose ``Path.name`` is empty or ``..``."""
    return path.resolve().name or str(path.resolve())


def _line(exc: BaseException, most: int = 400) -> str:
    """An exception as one line: its type and the first line of its message; where that line ends in a colon, the
    lines it introduces too, joined (transformers' tokenizer error gives its reasons there: "You need to have
    sentencepiece ... installed"), up to ``most`` characters.

    >>> _line(ValueError("Couldn't instantiate it from one of: \\n(1) a file, \\n(2) a class."))
    "ValueError: Couldn't instantiate it from one of: (1) a file, (2) a class."
    """
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not text:
        return type(exc).__name__
    shown = " ".join(text) if text[0].endswith(":") else text[0]
    return f"{type(exc).__name__}: {shown if len(shown) <= most else shown[:most - 3] + '...'}"


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


def _no_tokenizer(folder: str, path: Path, model_type: Optional[str]) -> Tf32LabError:
    return Tf32LabError(f"workload 'hf:{folder}': a text model (model type {model_type!r}) with no tokenizer in "
                        f"{path} (tokenizer.json or vocabulary files): save one there with tokenizer.save_pretrained")


def _found(path: Path, most: int = 6) -> str:
    """The folder's file names, for a line that says what is there: ``config.json, tf_model.h5``."""
    names = sorted(entry.name for entry in path.iterdir())
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _weights(folder: str, path: Path) -> None:
    """Refuses a folder with no weights transformers reads, naming what it holds: transformers' own line names one
    file only, and a config alone would be a model of random weights nobody trained."""
    if not any((path / name).is_file() for name in _WEIGHTS):
        raise Tf32LabError(f"workload 'hf:{folder}': no weights in {path} (found: {_found(path)}); accepted: "
                           f"{', '.join(_WEIGHTS)}, as save_pretrained writes them")


def _tokenizer(folder: str, path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise Tf32LabError(f"workload 'hf:{folder}': loading its tokenizer failed: {_line(exc)}") from exc
    if tokenizer.pad_token is None:
        # GPT-2's and Llama's tokenizers ship without one; the attention mask hides the padding either way, so a
        # tokenizer with no special token at all pads with its first vocabulary entry
        found = tokenizer.eos_token or tokenizer.bos_token or tokenizer.unk_token
        if found is None:
            found = tokenizer.convert_ids_to_tokens(0)
        if found is None:
            raise Tf32LabError(f"workload 'hf:{folder}': its tokenizer has no pad token and no token to pad with "
                               f"(an empty vocabulary)")
        tokenizer.pad_token = found
    return tokenizer


def embedding_rows(model: torch.nn.Module) -> Optional[int]:
    """How many token ids the model's input embedding has (None where it does not say).

    >>> class Tiny(torch.nn.Module):  # as a transformers model says it
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.tokens = torch.nn.Embedding(300, 8)
    ...     def get_input_embeddings(self):
    ...         return self.tokens
    >>> embedding_rows(Tiny()), embedding_rows(torch.nn.Linear(2, 2))
    (300, None)
    """
    try:
        found = model.get_input_embeddings()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    size = getattr(found, "num_embeddings", None)
    return size if isinstance(size, int) and size > 0 else None


def _pad_in_range(tokenizer: Any, model: torch.nn.Module) -> None:
    """A pad id the model's embedding has. transformers 5 builds a folder's tokenizer as its model type's class,
    which may add a pad token of its own past the vocabulary (a Qwen2 folder's ``<|endoftext|>`` got id 300 beside
    300 embeddings), as does a pad token added to a tokenizer without resizing the model. Masked out either way,
    the pad still goes through the embedding, which raised "index out of range" at the float64 reference."""
    size = embedding_rows(model)
    pad = getattr(tokenizer, "pad_token_id", None)
    if size is None or not isinstance(pad, int) or pad < size:
        return
    for token in (tokenizer.eos_token, tokenizer.bos_token, tokenizer.unk_token):
        found = tokenizer.convert_tokens_to_ids(token) if token is not None else None
        if isinstance(found, int) and 0 <= found < size:
            tokenizer.pad_token = token
            return
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)


def _ids_in_range(folder: str, ids: torch.Tensor, model: torch.nn.Module) -> None:
    """Refuses text the model cannot embed: a tokenizer of more ids than the model's embedding (another model's
    tokenizer, or tokens added without ``resize_token_embeddings``) raised "index out of range in self" at the
    float64 reference, as if the model were at fault."""
    size = embedding_rows(model)
    if size is not None and ids.numel() and int(ids.max()) >= size:
        raise Tf32LabError(f"workload 'hf:{folder}': its tokenizer gives token id {int(ids.max())}, past the "
                           f"model's {size} input embeddings: a tokenizer of another model, or tokens added "
                           f"without resize_token_embeddings")


def _capturing_hooks_installed(model: torch.nn.Module) -> None:
    """transformers 5's output-capturing hooks installed now, as its first call would install them. The call
    marks the model (``_output_capturing_hooks_installed``) as it adds them; the check puts back every attribute
    and hook a run adds (``measure.state``; before it put back the mark alone, each run installed the hooks again
    and a SegFormer's decode head, which reads every stage's hidden state, got each twice: every level raised).
    Installed before the check, the mark and the hooks are the model's own state, not something each run does,
    which the report would call state the model keeps."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # an earlier transformers: outputs are returned, not captured by hooks
        return
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        while forward is not None:  # the models whose forward is wrapped by transformers' capture_outputs
            # (functools.wraps gives the wrapper the model's __qualname__: its code object keeps its own)
            if "capture_outputs" in getattr(getattr(forward, "__code__", None), "co_qualname", ""):
                maybe_install_capturing_hooks(module)
                break
            forward = getattr(forward, "__wrapped__", None)


def _transformers(folder: str) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise Tf32LabError(f"workload 'hf:{folder}' needs transformers: pip install transformers") from None


_UNREADABLE = "its weights could not be read (a truncated or corrupt file?)"


def _unreadable(exc: BaseException) -> bool:
    """Whether loading failed on the weights' bytes (safetensors' header, a pickle), not on the model."""
    import pickle

    return "safetensor" in type(exc).__name__.lower() or isinstance(exc, (pickle.UnpicklingError, EOFError))


def _load(cls: Any, path: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``cls.from_pretrained`` from the folder only, quietly, and transformers' loading info (for
    :func:`_complete`). A mixture of experts runs its experts one GEMM each
    ("eager"), not transformers' default grouped GEMM (``torch._grouped_mm``): that has no float64 kernel for the
    reference, and each expert's GEMM is then one the emulator rounds as the hardware's."""
    import transformers

    options: dict[str, Any] = {"local_files_only": True, "output_loading_info": True}
    if hasattr(transformers.PreTrainedModel, "set_experts_implementation"):  # transformers 5
        options["experts_implementation"] = "eager"
    with quiet_loading():
        try:
            model, found = cls.from_pretrained(str(path), **options)
        except RuntimeError as exc:
            if "ignore_mismatched_sizes" not in str(exc):
                raise
            # transformers' line points at its load report, which quiet_loading silenced: loaded again, its
            # mismatched tensors re-made at random instead, to name them (and refuse)
            return cls.from_pretrained(str(path), ignore_mismatched_sizes=True, **options)
    return model, found


def _complete(folder: str, found: dict[str, Any]) -> None:
    """Refuses weights that leave some of the model's tensors to transformers' random initialization: tensors
    missing from the file (transformers' "newly initialized"), or saved in another shape than the config makes
    them. The check would measure a model nobody trained, as it would a config with no weights at all. Tensors
    the file holds beyond the model's (a head the class has not) change nothing and are not refused."""
    missing = sorted(found.get("missing_keys") or ())
    mismatched = sorted(found.get("mismatched_keys") or (), key=str)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise Tf32LabError(f"workload 'hf:{folder}': its weights lack {len(missing)} of the model's tensors "
                           f"({shown}), which transformers would make at random: the check would measure a model "
                           f"nobody trained; accepted: weights holding every tensor of the model, as save_pretrained "
                           f"writes them")
    if mismatched:
        first = mismatched[0]
        said = (f"{first[0]}: saved {tuple(first[1])}, config.json makes {tuple(first[2])}"
                if isinstance(first, tuple) and len(first) == 3 else str(first))
        raise Tf32LabError(f"workload 'hf:{folder}': its weights do not fit its config.json: {len(mismatched)} "
                           f"tensors were saved in another shape ({said}); accepted: the config.json the weights "
                           f"were saved with")


def causal_lm(folder: str) -> CausalLM:
    """The causal language model in ``folder`` (``AutoModelForCausalLM``) and its tokenizer, padding on the left."""
    path = _folder(folder)
    _transformers(folder)
    from transformers import AutoModelForCausalLM

    _decoder_only(folder, _config(folder, path))
    if not _has_tokenizer(path):  # transformers' own error named a backend, not the missing files
        raise _no_tokenizer(folder, path, _model_type(path))
    tokenizer = _tokenizer(folder, path)
    tokenizer.padding_side = "left"  # new tokens follow each prompt's last token
    _weights(folder, path)
    try:
        model, found = _load(AutoModelForCausalLM, path)
    except Exception as exc:
        if _unreadable(exc):
            raise Tf32LabError(f"workload 'hf:{folder}': {_UNREADABLE}: {_line(exc)}") from exc
        raise Tf32LabError(f"workload 'hf:{folder}': not a causal language model, or loading failed: "
                           f"{_line(exc)}") from exc
    _complete(folder, found)
    _pad_in_range(tokenizer, model)
    saved = _saved_dtype(model.config)
    # a model served in bfloat16 runs no TF32: the rows are the float32 model's text, said as the check says it
    notes = () if saved is None else (f"weights saved as {saved}, decoded in float32: TF32 changes float32 "
                                      f"matmuls, so these are the float32 model's tokens",)
    unread = _unread_generation_config(path)
    return CausalLM(model.float().eval(), tokenizer, _name(path), notes + ((unread,) if unread else ()))


def _unread_generation_config(path: Path) -> Optional[str]:
    """A note where the folder's ``generation_config.json`` cannot be read: transformers loads the model without it,
    silently, and ``generate()`` then applies none of its settings; neither can the check name them (sampling,
    penalties) as it names those of a config it reads."""
    if not (path / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    try:
        with quiet_loading():
            GenerationConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        return (f"its generation_config.json could not be read ({_line(exc, most=160)}): transformers loads the "
                f"model without it, so neither generate() nor this check applies or names its settings")
    return None


def _saved_dtype(config: Any) -> Optional[str]:
    """The dtype the folder's weights are saved in (``bfloat16``), where not float32; None where float32 or not
    said. TF32 is a float32 question: the weights are upcast."""
    # read from the instance: transformers 5's torch_dtype property logs a deprecation line to stderr
    saved = vars(config).get("dtype") or vars(config).get("torch_dtype")
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    if isinstance(saved, torch.dtype) and saved != torch.float32:
        return str(saved).removeprefix("torch.")
    return None


def _decoder_only(folder: str, config: Any) -> None:
    """Refuses what the generation check cannot decode, before its tokenizer is asked for: an encoder-decoder
    (``AutoModelForCausalLM`` gave BART's decoder alone, without the encoder its cross-attention reads), a model
    type with no causal-LM class (a ViT was "a text model with no tokenizer", a BERT a transformers line naming
    configuration classes) and a masked LM's weights (a RoBERTa saved as ``RobertaForMaskedLM`` loaded as
    ``RobertaForCausalLM``: an encoder, attending both ways, decoded as if it were a decoder)."""
    import transformers

    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
    except ImportError:  # another layout: loading says what is wrong
        return
    model_type = getattr(config, "model_type", None)
    known = [name for name in getattr(config, "architectures", None) or [] if hasattr(transformers, name)]
    classes = {name for found in causal.values() for name in ((found,) if isinstance(found, str) else found)}
    if getattr(config, "is_encoder_decoder", False):
        why = "an encoder-decoder"
    elif model_type not in causal:
        why = "not a causal language model"
    elif known and not classes.intersection(known):
        why = f"saved as {', '.join(known)}, not a causal language model"
    else:
        return
    raise Tf32LabError(f"workload 'hf:{folder}': model type {model_type!r} is {why}; the generation check decodes "
                       f"a decoder-only causal language model (GPT-2, Llama, Qwen2, Mistral, Phi, Gemma: "
                       f"AutoModelForCausalLM's model types); check it without --generate")


def _config(folder: str, path: Path) -> Any:
    from transformers import AutoConfig

    try:
        with quiet_loading():
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        model_type = _model_type(path)
        shape = _config_shape(path)
        if shape:
            raise Tf32LabError(f"workload 'hf:{folder}': its config.json {shape}; accepted: a config.json as "
                               f"save_pretrained writes it, with the model_type transformers builds it by") from None
        if model_type is not None and "does not recognize" in str(exc):
            raise Tf32LabError(f"workload 'hf:{folder}': model type {model_type!r} is unknown to this transformers; "
                               f"supported: {SUPPORTED}") from None
        if _custom_code(path):
            raise Tf32LabError(f"workload 'hf:{folder}': its config.json names the folder's own code (auto_map), "
                               f"which tf32lab never runs; supported: {SUPPORTED}") from None
        raise Tf32LabError(f"workload 'hf:{folder}': reading its config.json failed: {_line(exc)}") from None


def _config_shape(path: Path) -> str:
    """What is wrong with the shape of a config.json that parses (empty: nothing found wrong)."""
    import json

    try:
        found = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(found, dict):
        return f"is a JSON {type(found).__name__}, not an object"
    if "model_type" not in found and "auto_map" not in found:
        keys = ", ".join(sorted(found)[:6]) + (" ..." if len(found) > 6 else "")
        return f"has no model_type (its keys: {keys or 'none'})"
    return ""


def _custom_code(path: Path) -> bool:
    import json

    try:
        return "auto_map" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def _model_type(path: Path) -> Optional[str]:
    import json

    try:
        found = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def _model(folder: str, path: Path, config: Any) -> tuple[torch.nn.Module, Optional[str]]:
    """The class ``config.architectures`` names, as the folder's weights were saved from; else ``AutoModel``, with a
    note naming the class asked for and the one checked (a bare model: no head, hidden states compared)."""
    import transformers

    asked = [name for name in (getattr(config, "architectures", None) or []) if isinstance(name, str)]
    names = [name for name in asked if hasattr(transformers, name)]
    cls = getattr(transformers, names[0]) if names else transformers.AutoModel
    _weights(folder, path)
    try:
        model, found = _load(cls, path)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise Tf32LabError(f"workload 'hf:{folder}': model type {config.model_type!r} has no model class here; "
                               f"supported: {SUPPORTED}") from None
        raise Tf32LabError(f"workload 'hf:{folder}': loading failed: {_line(exc)}") from exc
    except Exception as exc:
        if _unreadable(exc):
            raise Tf32LabError(f"workload 'hf:{folder}': {_UNREADABLE}: {_line(exc)}") from exc
        raise Tf32LabError(f"workload 'hf:{folder}': loading failed: {_line(exc)}") from exc
    _complete(folder, found)
    note = None
    if not names:
        named = (f"names {', '.join(asked)}, a class this transformers does not have" if asked else
                 "names no architectures")
        note = f"its config {named}: checked as {type(model).__name__} (AutoModel), without a head"
    return model.float().eval(), note


def _parameters(model: torch.nn.Module) -> dict[str, inspect.Parameter]:
    try:
        found = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {name: p for name, p in found.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _cache_through_kwargs(model: torch.nn.Module, config: Any) -> bool:
    """Whether a model passes ``use_cache`` on to a language model inside through ``**kwargs`` (LLaVA): its forward
    does not name it, and its cache would be compared as an output, "differing" at every level."""
    try:
        found = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return any(p.kind is p.VAR_KEYWORD for p in found) and isinstance(getattr(text, "use_cache", None), bool)


def _text(folder: str, path: Path, config: Any, model: torch.nn.Module, sentences: int) -> dict[str, torch.Tensor]:
    if not _has_tokenizer(path):
        raise _no_tokenizer(folder, path, config.model_type)
    tokenizer = _tokenizer(folder, path)
    _pad_in_range(tokenizer, model)
    # no longer than the model's positions: a longer sentence indexed past its position table (a CLIP keeps them
    # in its text sub-config)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    limit = next((found for found in (getattr(text, name, None) for name in ("max_position_embeddings",
                  "n_positions")) if isinstance(found, int) and found > 0), None)
    cut = {"truncation": True, "max_length": limit} if limit is not None else {}
    features = tokenizer(list(samples.SENTENCES[:sentences]), padding=True, return_tensors="pt", **cut)
    inputs = {key: value for key, value in features.items() if isinstance(value, torch.Tensor)}
    _ids_in_range(folder, inputs["input_ids"], model)
    if getattr(config, "is_encoder_decoder", False):
        ids, mask = inputs["input_ids"], inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))
        start = _start_token(config, tokenizer.pad_token_id)
        inputs["decoder_input_ids"] = torch.cat([torch.full_like(ids[:, :1], start), ids[:, :-1]], 1)
        inputs["decoder_attention_mask"] = torch.cat([torch.ones_like(mask[:, :1]), mask[:, :-1]], 1)
    return inputs


def _start_token(config: Any, default: Optional[int]) -> int:
    for found in (getattr(config, "decoder_start_token_id", None), getattr(config, "bos_token_id", None), default):
        if isinstance(found, int):
            return found
    return 0


def _processor(path: Path, kind: str) -> tuple[Any, str]:
    """The folder's image processor or feature extractor, if it has a saved one (``preprocessor_config.json``), and
    else why not, for the note: a saved processor that is not used must not pass unsaid (no Pillow, say)."""
    if not (path / "preprocessor_config.json").is_file():
        return None, ""
    import transformers

    cls = transformers.AutoImageProcessor if kind == "image" else transformers.AutoFeatureExtractor
    try:
        with quiet_loading():
            return cls.from_pretrained(str(path), local_files_only=True), ""
    except Exception as exc:  # a processor of the other kind, or one this transformers cannot build: the config decides
        return None, f"; its {kind} processor not used: {_line(exc).rstrip(':')}"


def _size(value: Any, default: int = 224) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return value[0], value[1]
    return default, default


def _pixels(path: Path, config: Any, count: int) -> tuple[dict[str, torch.Tensor], str]:
    draw = torch.Generator().manual_seed(_SEED)
    # a CLIP's image size is its vision tower's, an image-to-text encoder-decoder's its encoder's
    config = next((sub for sub in (getattr(config, name, None) for name in ("vision_config", "encoder"))
                   if hasattr(sub, "image_size")), config)
    channels = getattr(config, "num_channels", 3)
    height, width = _size(getattr(config, "image_size", None))
    processor, unused = _processor(path, "image")
    if processor is not None and channels == 3:
        images = torch.randint(0, 256, (count, height, width, 3), dtype=torch.uint8, generator=draw)
        found = processor(images=list(images.numpy()), return_tensors="pt")
        return {"pixel_values": found["pixel_values"].float()}, "seeded random images through its image processor"
    pixels = torch.randn(count, channels, height, width, generator=draw)
    return {"pixel_values": pixels}, f"seeded normalized pixels of the config's size{unused}"


def _waves(count: int, samples_: int) -> list[Any]:
    """Seeded noise with a tone, zero mean and unit variance: what a normalized waveform looks like."""
    draw = torch.Generator().manual_seed(_SEED)
    t = torch.arange(samples_, dtype=torch.float32) / _RATE
    waves = torch.randn(count, samples_, generator=draw) + torch.sin(2 * torch.pi * 440.0 * t)
    waves = (waves - waves.mean(1, keepdim=True)) / waves.std(1, keepdim=True)
    return list(waves.numpy())


def _audio(folder: str, path: Path, config: Any, main: str, count: int) -> tuple[dict[str, torch.Tensor], str]:
    extractor, unused = _processor(path, "audio")
    if extractor is not None:
        rate = getattr(extractor, "sampling_rate", _RATE)
        length = getattr(extractor, "n_samples", rate)  # Whisper's extractor pads to its chunk (30 s)
        found = extractor(_waves(count, length), sampling_rate=rate, return_tensors="pt")
        if main in found:
            return {main: found[main].float()}, "seeded noise through its feature extractor"
    bins, frames = getattr(config, "num_mel_bins", None), getattr(config, "max_length", None)
    if main == "input_values" and isinstance(bins, int) and isinstance(frames, int):
        # a spectrogram transformer (AST) names its filter-bank frames input_values too, [batch, frames, bins]:
        # a waveform raised "Dimension out of range" at the reference
        draw = torch.Generator().manual_seed(_SEED)
        features = torch.randn(count, frames, bins, generator=draw).mul_(0.5).clamp_(-1.5, 1.5)
        return {main: features}, f"seeded filter-bank-like features of the config's size{unused}"
    if main == "input_values":
        waves = torch.stack([torch.from_numpy(wave) for wave in _waves(count, _RATE)])  # one array, not a list
        return {main: waves}, f"one second of seeded noise at 16 kHz{unused}"
    bins, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    per_channel = getattr(config, "input_feat_per_channel", None)
    if isinstance(per_channel, int):
        # Speech2Text: [batch, frames, filter banks], any number of frames its subsampling convolutions leave
        # within its positions (each halves them); 4 s at the usual 10 ms hop
        channels = getattr(config, "input_channels", 1)
        width = per_channel * (channels if isinstance(channels, int) and channels > 0 else 1)
        frames = min(400, 2 * positions) if isinstance(positions, int) and positions > 0 else 400
        draw = torch.Generator().manual_seed(_SEED)
        features = torch.randn(count, frames, width, generator=draw).mul_(0.5).clamp_(-1.5, 1.5)
        return {main: features}, f"seeded filter-bank-like features of the config's size{unused}"
    if not (isinstance(bins, int) and isinstance(positions, int)):
        raise Tf32LabError(f"workload 'hf:{folder}': model type {config.model_type!r} takes input_features but the "
                           f"folder has no feature extractor (preprocessor_config.json) to make them; supported: "
                           f"{SUPPORTED}")
    draw = torch.Generator().manual_seed(_SEED)
    # Whisper's encoder takes exactly 2 * max_source_positions frames (its convolutions halve them)
    features = torch.randn(count, bins, 2 * positions, generator=draw).mul_(0.5).clamp_(-1.5, 1.5)
    return {main: features}, f"seeded log-mel-like features of the config's size{unused}"


def _dual_encoder(model: torch.nn.Module) -> bool:
    """A text tower and an image tower side by side (CLIP, SigLIP, ALIGN): both features are what it computes, so
    both inputs are needed. A vision-language decoder (LLaVA) also takes pixels but places them at image tokens
    of the text, which the sample sentences do not have."""
    return all(callable(getattr(model, name, None)) for name in ("get_text_features", "get_image_features"))


def _decoder_ids(config: Any, count: int) -> torch.Tensor:
    draw = torch.Generator().manual_seed(_SEED)
    ids = torch.randint(0, int(getattr(config, "vocab_size", 2) or 2), (count, 8), generator=draw)
    ids[:, 0] = _start_token(config, 0)
    return ids


def _sentence_transformer(folder: str, path: Path, sentences: int) -> Workload:
    """A sentence-transformers folder (``modules.json``): its whole pipeline (transformer, pooling, normalizing),
    compared on ``sentence_embedding``, as ``minilm`` is; the bare transformer's outputs (BERT's pooler among them)
    are not what its user reads."""
    from tf32lab.workloads.builtin import SentenceEmbedder

    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise Tf32LabError(f"workload 'hf:{folder}' is a sentence-transformers folder (modules.json) and needs "
                           f"sentence-transformers: pip install sentence-transformers") from None
    try:
        with quiet_loading():
            st = SentenceTransformer(str(path), device="cpu", local_files_only=True)
    except Exception as exc:
        raise Tf32LabError(f"workload 'hf:{folder}': loading it as a sentence-transformers folder failed: "
                           f"{_line(exc)}") from exc
    preprocess = getattr(st, "preprocess", None) or st.tokenize
    found = preprocess(list(samples.SENTENCES[:sentences]))
    inputs = {name: value for name, value in found.items() if isinstance(value, torch.Tensor)}
    note = f"inputs: {samples.shapes(inputs)} (the sample sentences through its sentence-transformers pipeline)"
    return Workload(SentenceEmbedder(st.eval()), inputs, name=_name(path), notes=(note,))


def workload(folder: str, sentences: int = 16) -> Workload:
    """A transformers model from a local folder, fed sample inputs of the kind it takes (see the module's
    docstring): the first ``sentences`` sample sentences, or ``min(sentences, 4)`` images or audio clips.
    What is not supported raises ``Tf32LabError`` with one line naming the model type and what is."""
    path = _folder(folder)
    _transformers(folder)
    if (path / "modules.json").is_file():
        return _sentence_transformer(folder, path, sentences)
    config = _config(folder, path)
    model, fallback = _model(folder, path, config)
    _capturing_hooks_installed(model)
    accepted = _parameters(model)
    main = getattr(model, "main_input_name", "input_ids")
    count = max(1, min(sentences, _IMAGES))
    if main == "input_ids":
        inputs, how = _text(folder, path, config, model, sentences), "the sample sentences through its tokenizer"
        if "pixel_values" in accepted and _dual_encoder(model):
            # a text-image model (CLIP, SigLIP) scores each image against each sentence: it needs both, and
            # raised on pixel_values None at the reference
            pixels, seen = _pixels(path, config, count)
            inputs.update(pixels)
            how += f", {seen}"
        elif "pixel_values" in accepted:
            how += ", no images: they go at image tokens the sentences do not have, so its text path is checked"
    elif main == "pixel_values":
        inputs, how = _pixels(path, config, count)
    elif main in ("input_values", "input_features"):
        inputs, how = _audio(folder, path, config, main, count)
    else:
        raise Tf32LabError(f"workload 'hf:{folder}': model type {config.model_type!r} takes {main}; supported: "
                           f"{SUPPORTED}")
    if "decoder_input_ids" in accepted and "decoder_input_ids" not in inputs:
        inputs["decoder_input_ids"] = _decoder_ids(config, next(iter(inputs.values())).size(0))
        how += ", seeded decoder ids"
    inputs = {name: value for name, value in inputs.items() if name in accepted}
    missing = [name for name, p in accepted.items() if p.default is inspect.Parameter.empty and name not in inputs]
    if missing:
        raise Tf32LabError(f"workload 'hf:{folder}': model type {config.model_type!r} ({type(model).__name__}) also "
                           f"needs {', '.join(missing)}; supported: {SUPPORTED}")
    shapes = samples.shapes(inputs)
    if "use_cache" in accepted or _cache_through_kwargs(model, config):
        inputs["use_cache"] = False  # compare what the forward computes, not the next step's cache
    note = f"inputs: {shapes} ({how}{', use_cache=False' if 'use_cache' in inputs else ''})"
    saved = _saved_dtype(config)
    if saved is not None:
        note += f"; weights saved as {saved}, checked in float32"
    return Workload(model, inputs, name=_name(path), notes=(note,) if fallback is None else (note, fallback))
