"""Imported first by the bench scripts: the repository root leads sys.path.

A script's own folder leads sys.path, and bench/kv_transfer.py, named like the package
it measures, would then shadow the kv_transfer package that deployments imports.
"""

import sys
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if sys.path[:1] != [REPO_ROOT]:
    sys.path.insert(0, REPO_ROOT)
