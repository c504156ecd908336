"""control: PyTorch's precision state. ``flags`` is the only code that reads and writes it; ``scope`` keeps who asked
for which level (``precision()``, set/get); ``policy`` holds levels per module as data, ``pinning`` applies them
(``patterns``: which rule shadows which); ``modestack`` puts tf32lab's modes on a thread's stacks."""
