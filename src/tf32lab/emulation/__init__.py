"""emulation: ``emulate(target)``, every matmul-family op computed as the target would (``emulator``), with one rule
per aten op (``rules``; attention's in ``attention_rules``)."""
