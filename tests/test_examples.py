"""The examples run as a user would run them, and say what they claim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_value_head_example_pins_the_head_and_keeps_the_bodys_tf32():
    done = subprocess.run([sys.executable, str(EXAMPLES / "value_head" / "train.py"), "--steps", "8"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the head's error is float32's, the body's is TF32's" in done.stdout
    assert "The policy (`high` by default, 'v_head' → `highest`) is within tolerance" in done.stdout
