"""measure: ``check``, the error each level puts into a workload's outputs and layers against a float64 reference
(``reference``; large kept outputs spill to disk, ``spill``)."""
