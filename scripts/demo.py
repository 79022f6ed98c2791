"""`make demo`: a training job on 5 simulated nodes that survives injected failures.

See demo/run.py (``python scripts/demo.py --help``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
