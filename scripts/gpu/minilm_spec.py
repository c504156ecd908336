"""Workload factories for ``tf32lab check`` on a GPU: an all-MiniLM-L6-v2-sized BERT encoder, random weights.

The same seeded model and token batch on CUDA (``cuda``, for ``--target native``) or on the CPU (``cpu``, for an
emulated target such as ``--target h100``), so the two reports can be set side by side:

    PYTHONPATH=src python -m tf32lab.cli check scripts/gpu/minilm_spec.py:cuda --target native --levels highest,high
    PYTHONPATH=src python -m tf32lab.cli check scripts/gpu/minilm_spec.py:cpu --target h100 --levels highest,high

Without a GPU, ``cuda`` builds the model on the CPU.
"""

from __future__ import annotations

import torch

import tf32lab


class _Embedder(torch.nn.Module):
    """BERT encoder + mean pooling over the attention mask, as sentence-transformers computes embeddings."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask[..., None].to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1)


def _make(device: str) -> tf32lab.Workload:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512)
    model = _Embedder(BertModel(config)).eval().to(device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 30000, (64, 32), generator=g)
    mask = torch.ones(64, 32, dtype=torch.long)
    for i, length in enumerate(torch.randint(16, 33, (64,), generator=g).tolist()):
        mask[i, length:] = 0
    return tf32lab.Workload(model, {"input_ids": ids.to(device), "attention_mask": mask.to(device)},
                            name=f"MiniLM-L6-sized encoder ({device})")


def cuda() -> tf32lab.Workload:
    return _make("cuda" if torch.cuda.is_available() else "cpu")


def cpu() -> tf32lab.Workload:
    return _make("cpu")
