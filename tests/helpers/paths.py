"""The checkout's folders, as the tests find them from here (whatever folder a test is in)."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]      # the checkout: attnext/, csrc/, kernels/, tests/
TESTS = ROOT / "tests"
CSRC = ROOT / "csrc"
KERNELS = ROOT / "kernels"


def pythonpath(*first):
    """A PYTHONPATH for a child process: `first`, the checkout (attnext importable without an
    install) and tests/ (conftest, helpers), then the inherited one."""
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    folders = [*map(str, first), str(ROOT), str(TESTS), *inherited]
    return os.pathsep.join(dict.fromkeys(p for p in folders if p))
