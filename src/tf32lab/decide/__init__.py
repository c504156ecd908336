"""decide: ``tune``, the fastest policy that keeps a workload within its tolerance on a target, verified."""
