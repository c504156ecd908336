"""workloads: a model and its example inputs (``workload``), named by spec strings (``specs``), and the built-in
ones (``builtin``, ``samples``: all-MiniLM-L6-v2 and small seeded models)."""
