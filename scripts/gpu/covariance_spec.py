"""The built-in one-pass covariance on the GPU, for `tf32lab check --target native` there: its `mean.T @ mean` is an
outer product (K = 1), which cuBLAS runs without TF32 on Hopper, so only the Gram term `samples.T @ samples` is TF32.

    PYTHONPATH=src python3 -m tf32lab check scripts/gpu/covariance_spec.py:cuda --target native --levels highest,high
"""

from __future__ import annotations

import tf32lab
from tf32lab.workloads.builtin import covariance


def cuda() -> tf32lab.Workload:
    workload = covariance()
    return tf32lab.Workload(workload.model.cuda(), workload.inputs.cuda(), name="one-pass covariance (cuda)")
