"""The checkout's folders, as the tests find them from here (whatever folder a test is in)."""
import ast
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


def setup_py():
    """setup.py's imports, functions and constants (CFLAGS, ...), executed without its setup()
    call, which would build the extension."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef))
            or (isinstance(n, ast.Assign) and all(isinstance(t, ast.Name) for t in n.targets))]
    ns = {"__file__": str(ROOT / "setup.py")}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "setup.py", "exec"), ns)
    return ns
