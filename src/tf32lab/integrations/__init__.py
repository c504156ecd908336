"""Integrations: the training check inside the training loops users already have.

- :mod:`tf32lab.integrations.lightning`: ``Tf32Check``, a PyTorch Lightning ``Callback``;
- :mod:`tf32lab.integrations.transformers`: ``Tf32CheckCallback``, a Hugging Face ``TrainerCallback``.

Each one, when training starts, runs :func:`tf32lab.check_training` on the run's own model, loss, optimizer and
scheduler and first batches, and leaves the run itself bit-identical to a run without it. Neither framework is
imported by ``import tf32lab`` nor by this package: only by the module of its integration (``pip install
'tf32lab[lightning]'`` or ``'tf32lab[transformers]'``).
"""
