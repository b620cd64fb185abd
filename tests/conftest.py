"""Shared test helpers live beside this file (``_spawn.py``, ``_warm.py``); make them importable from every folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
