"""HF ⇄ megarl checkpoint conversion (same as ``megarl convert ...``).

    python tools/convert.py hf-to-megarl --hf HF_DIR --out CKPT_ROOT [--tp N] [--pp M]
    python tools/convert.py megarl-to-hf --ckpt CKPT --out HF_DIR [--tp N] [--pp M]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["convert", *sys.argv[1:]]))
