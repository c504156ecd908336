"""Whether Dynamo is back to compiling after emulate(): its stance (torch >= 2.6), or, before stances existed, its
own frame-callback setter (which emulate() replaces while a block is open)."""

from __future__ import annotations


def compiling_restored() -> bool:
    import torch
    from torch._dynamo import eval_frame

    if hasattr(eval_frame, "_stance"):
        return eval_frame._stance.stance == "default"
    return eval_frame.set_eval_frame is torch._C._dynamo.eval_frame.set_eval_frame

