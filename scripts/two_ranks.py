"""Two ranks sharing one directory, with faults in one of them: ``python scripts/two_ranks.py``.

The work lives in ``kvoffload/bench/ranks.py`` (spawned ranks must import it by
name); this file only makes the repository importable and runs it.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvoffload.bench.ranks import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
