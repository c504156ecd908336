"""control: PyTorch's precision state. ``flags`` is the only code that reads and writes it; ``scope`` keeps who asked
for which level (``precision()``, set/get); ``policy`` applies levels per module; ``modestack`` puts tf32lab's
modes on a thread's stacks."""
