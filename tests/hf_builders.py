"""Tiny Hugging Face model folders for the tests, made offline: a model from its config with random weights, a
byte-level BPE tokenizer trained on the sample sentences, saved as ``save_pretrained`` writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from tf32lab.workloads import samples

VOCAB = 300  # a sample sentence is ~60 tokens: short inputs, fast checks


def tokenizer(vocab: int = VOCAB, added: tuple[str, ...] = (), **special: str) -> Any:
    """A fast tokenizer of ``vocab`` ids with ``special`` tokens among them; ``added`` tokens come after them (ids
    ``vocab``, ``vocab + 1``, ...), as tokens added to a trained tokenizer do."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=sorted(set(special.values())),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(samples.SENTENCES), trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    if added:
        fast.add_special_tokens({"additional_special_tokens": list(added)})
    return fast


def folder(path: Path, model: torch.nn.Module, tok: Optional[Any] = None) -> Path:
    """``model`` (and ``tok``) saved in ``path``, weights seeded by the caller."""
    model.save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    return path


def llama(vocab: int = VOCAB, **config: Any) -> torch.nn.Module:
    """A two-layer Llama-architecture decoder, 32 wide, grouped-query attention."""
    import transformers

    torch.manual_seed(0)
    found = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    found.update(config)  # a test's own table length among them
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**found))
