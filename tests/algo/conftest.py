"""Make the checkout importable when ``megarl`` is not installed.

Only needed until the project config sets ``pythonpath = ["."]`` for pytest (or the
package is installed); harmless afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
