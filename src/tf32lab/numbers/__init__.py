"""numbers: pure helpers with no global state. Bit-exact formats, error metrics and tolerances, nested trees of
tensors, whole-or-nothing file writes, and whose exception a traceback holds."""
