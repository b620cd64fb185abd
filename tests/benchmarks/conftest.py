"""The benchmark scripts and their shared helpers (``benchmarks/``) importable by name from these tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
