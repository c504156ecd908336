"""machine: this machine. What it has (``hardware``), what its kernels really do (``probe``), what ``torch.compile``
changes (``inductor``), the compile cache, and the two verbs about it: ``autoconfig`` and ``doctor``."""
