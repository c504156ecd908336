"""Models from a local Hugging Face folder (``hf:FOLDER``): nothing is downloaded.

:func:`workload` is what ``tf32lab check hf:FOLDER`` measures; :func:`causal_lm` gives a decoder and its
tokenizer for the generation check. Tokenizers shipped without a pad token (GPT-2's, Llama's) pad with their
end-of-sequence token, on the left, as generation needs.

Example:

    >>> from tf32lab.workloads import hf
    >>> try:
    ...     hf.workload("/no/such/folder")
    ... except Exception as exc:
    ...     print(str(exc).split(": ", 1)[1])
    no config.json in /no/such/folder (a local transformers model folder)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tf32lab.errors import Tf32LabError
from tf32lab.workloads import samples
from tf32lab.workloads.workload import Workload

__all__ = ["CausalLM", "causal_lm", "workload"]


@dataclass
class CausalLM:
    """A causal language model (float32, eval mode) and its tokenizer (a pad token set), from ``hf:FOLDER``."""

    model: torch.nn.Module
    tokenizer: Any
    name: str


def _looks_like_hub_id(text: str) -> bool:
    """Whether ``text`` reads as a Hugging Face Hub id (``name`` or ``owner/name``) rather than a path."""
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", text)) and not text.endswith((".", "-"))


def _folder(folder: str) -> Path:
    path = Path(folder).expanduser()
    if not (path / "config.json").is_file():
        hub = "" if path.exists() or not _looks_like_hub_id(folder) else (
            f"; for a Hugging Face Hub id, download it once (`huggingface-cli download {folder} --local-dir DIR`, "
            f"or `huggingface_hub.snapshot_download({folder!r}, local_dir=DIR)`) and pass hf:DIR: nothing is "
            f"downloaded at run time")
        raise Tf32LabError(f"workload 'hf:{folder}': no config.json in {path} (a local transformers model "
                           f"folder){hub}")
    return path


def _tokenizer(folder: str, path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise Tf32LabError(f"workload 'hf:{folder}': loading its tokenizer failed: {type(exc).__name__}: {exc}") \
            from exc
    if tokenizer.pad_token is None:
        # GPT-2's and Llama's tokenizers ship without one; the attention mask hides the padding either way
        if tokenizer.eos_token is None:
            raise Tf32LabError(f"workload 'hf:{folder}': its tokenizer has neither a pad token nor an "
                               f"end-of-sequence token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _transformers(folder: str) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise Tf32LabError(f"workload 'hf:{folder}' needs transformers: pip install transformers") from None


def causal_lm(folder: str) -> CausalLM:
    """The causal language model in ``folder`` (``AutoModelForCausalLM``) and its tokenizer, padding on the left."""
    path = _folder(folder)
    _transformers(folder)
    from transformers import AutoModelForCausalLM

    tokenizer = _tokenizer(folder, path)
    tokenizer.padding_side = "left"  # new tokens follow each prompt's last token
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise Tf32LabError(f"workload 'hf:{folder}': not a causal language model, or loading failed: "
                           f"{type(exc).__name__}: {exc}") from exc
    return CausalLM(model.float().eval(), tokenizer, path.name)


def workload(folder: str, sentences: int = 16) -> Workload:
    """A transformers model and its tokenizer from a local folder, fed the first ``sentences`` sample sentences."""
    path = _folder(folder)
    _transformers(folder)
    from transformers import AutoModel

    tokenizer = _tokenizer(folder, path)
    try:
        model = AutoModel.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise Tf32LabError(f"workload 'hf:{folder}': loading failed: {type(exc).__name__}: {exc}") from exc
    features = tokenizer(list(samples.SENTENCES[:sentences]), padding=True, return_tensors="pt")
    return Workload(model.float().eval(), dict(features), name=path.name)
