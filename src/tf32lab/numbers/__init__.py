"""numbers: pure helpers with no global state. Bit-exact formats, error metrics and tolerances, nested trees of
tensors, whole-or-nothing file writes, whose exception a traceback holds, and
what a module is called."""
