"""``python -m tf32lab``: the ``tf32lab`` command, for environments where the console script is not on PATH."""

import sys

from tf32lab.cli import main

if __name__ == "__main__":
    sys.exit(main())
