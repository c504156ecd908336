"""know: the tables. Levels and the backend cells each one asks for, targets (the math each op family gets on a
piece of hardware, its peaks and bandwidth), and which aten ops are precision-sensitive. Lookups only: nothing here
reads or writes PyTorch's flags."""
