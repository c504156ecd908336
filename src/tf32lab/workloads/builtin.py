"""Built-in workloads: the real default (all-MiniLM-L6-v2), a small seeded model, and two precision-sensitive
computations that TF32 visibly breaks.

The sensitive ones reproduce reported incidents: a rotation applied and undone many times
(pytorch#61890, #79270), and a covariance computed in one pass as ``XᵀX/n − μᵀμ``, where two large Gram terms
cancel (like ``x @ eye``, pytorch#58688, the error is relative to the large terms, not to the small result).
Load them as ``tf32lab.workloads.builtin:rotation_round_trip`` and ``tf32lab.workloads.builtin:covariance``.

Example:

    >>> from tf32lab.workloads import builtin
    >>> w = builtin.covariance()
    >>> w.run().shape
    torch.Size([32, 32])
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tf32lab.workloads import samples
from tf32lab.workloads.workload import Workload

__all__ = ["covariance", "minilm", "rotation_round_trip", "small"]


# -- all-MiniLM-L6-v2 ------------------------------------------------------------------------------------------
class SentenceEmbedder(nn.Module):
    """A ``SentenceTransformer`` as a module of tensors: token features in, ``sentence_embedding`` out."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.st = transformer

    def forward(self, **features: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.st(dict(features, modality="text"))
        return {"sentence_embedding": out["sentence_embedding"]}


def minilm(device: str = "cpu") -> Workload:
    """all-MiniLM-L6-v2 embedding the 64 built-in sentences (needs the ``demo`` extra; loads offline)."""
    st = samples.minilm(device)
    preprocess = getattr(st, "preprocess", None) or st.tokenize
    features = {k: v.to(device) for k, v in preprocess(list(samples.SENTENCES)).items() if isinstance(v, torch.Tensor)}
    # named as an `hf:` folder's are: the same model checked from its folder takes 16 sentences, and predicts
    # another speedup for it
    note = f"inputs: {samples.shapes(features)} (the 64 built-in sentences through its sentence-transformers pipeline)"
    return Workload(SentenceEmbedder(st), features, name="all-MiniLM-L6-v2", notes=(note,))


# -- a small seeded model: a transformer classifier and a CNN --------------------------------------------------
class _TextClassifier(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


class _ImageClassifier(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(64, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))


class SmallModel(nn.Module):
    """A transformer text classifier and a CNN image classifier, side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.text = _TextClassifier()
        self.vision = _ImageClassifier()

    def forward(self, tokens: torch.Tensor, images: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"text_logits": self.text(tokens), "image_logits": self.vision(images)}


def small(seed: int = 0) -> Workload:
    """:class:`SmallModel` with weights and inputs drawn from ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SmallModel().eval()
        inputs = {"tokens": torch.randint(0, 512, (32, 24)), "images": torch.randn(16, 3, 32, 32)}
    return Workload(model, inputs, name="builtin")


# -- precision-sensitive computations --------------------------------------------------------------------------
def _rotation(angle: float) -> torch.Tensor:
    c, s = math.cos(angle), math.sin(angle)
    # about the axis (1, 1, 1)/sqrt(3), Rodrigues' formula
    k = torch.tensor([[0.0, -1.0, 1.0], [1.0, 0.0, -1.0], [-1.0, 1.0, 0.0]], dtype=torch.float64) / math.sqrt(3)
    return torch.eye(3, dtype=torch.float64) + s * k + (1 - c) * (k @ k)


class RotationRoundTrip(nn.Module):
    """Rotate points by a small angle ``steps`` times, then back as many times: the result should be the input."""

    def __init__(self, steps: int = 1024, angle: float = 0.05) -> None:
        super().__init__()
        rotation = _rotation(angle)
        self.register_buffer("forward_rotation", rotation.T.float().contiguous())
        self.register_buffer("backward_rotation", rotation.float().contiguous())
        self.steps = steps

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        for _ in range(self.steps):
            points = points @ self.forward_rotation
        for _ in range(self.steps):
            points = points @ self.backward_rotation
        return points


def rotation_round_trip(steps: int = 1024, points: int = 4096, seed: int = 0) -> Workload:
    """Points of a mesh far from the origin (coordinates ~1000), rotated ``steps`` times and back."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mesh = 1000.0 + torch.randn(points, 3)
    return Workload(RotationRoundTrip(steps), mesh, name="rotation round trip")


class Covariance(nn.Module):
    """The one-pass covariance ``XᵀX/n − μᵀμ``: two large Gram terms that cancel to a small difference."""

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        mean = samples.mean(dim=0, keepdim=True)
        return samples.T @ samples / samples.shape[0] - mean.T @ mean


def covariance(rows: int = 4096, cols: int = 32, offset: float = 10.0, seed: int = 0) -> Workload:
    """Samples whose mean (``offset``) is large against their spread (~1), as raw sensor or pixel data are."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        data = offset + torch.randn(rows, cols) @ (0.3 * torch.randn(cols, cols))
    return Workload(Covariance(), data, name="one-pass covariance")
