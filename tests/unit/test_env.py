"""attnext/_env.py: every ATTNEXT_* variable in its table, documented, and read through it alone.

Read as text and with ast: no module of attnext/ but _env.py reads os.environ for an ATTNEXT_*
name (nor with a key it computes, nor through os.environ's private dict); every ATTNEXT_* name
that attnext/, csrc/, setup.py, tests/ and bench/labs/ mention is in the table; the names C
reads with getenv are the table's C ones and setup.py's its BUILD ones.
"""
import ast
import os
import re

import pytest

import attnext
from attnext import _env

PACKAGE = os.path.dirname(attnext.__file__)
ROOT = os.path.dirname(PACKAGE)
NAME = re.compile(r"\bATTNEXT_[A-Z0-9_]*[A-Z0-9]\b")
GUARD = re.compile(r"_(H|CUH)$")        # C header guards (ATTNEXT_SEQLEN_H), not variables


def _files(folder, suffixes):
    for base, dirs, files in os.walk(os.path.join(ROOT, folder)):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        for f in files:
            if f.endswith(suffixes):
                yield os.path.join(base, f)


def _is_environ(node):
    """os.environ or a bare environ."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ")
            or (isinstance(node, ast.Name) and node.id == "environ"))


def _environ_reads(tree):
    """(line, key node) of each os.environ.get(k) / os.getenv(k) / os.environ[k] / k in os.environ,
    and (line, None) for any use of os.environ._data."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if (f.attr in ("get", "pop", "setdefault") and _is_environ(f.value)) or f.attr == "getenv":
                yield node.lineno, node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            yield node.lineno, node.slice
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            yield node.lineno, node.left
        elif isinstance(node, ast.Attribute) and node.attr == "_data" and _is_environ(node.value):
            yield node.lineno, None
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and node.args and _is_environ(node.args[0])):
            yield node.lineno, None


def test_only_env_reads_attnext_variables():
    bad = []
    for path in _files("attnext", ".py"):
        if os.path.samefile(path, _env.__file__):
            continue
        for line, key in _environ_reads(ast.parse(open(path).read(), path)):
            literal = isinstance(key, ast.Constant) and isinstance(key.value, str)
            if not literal or key.value.startswith("ATTNEXT_"):
                bad.append(f"{os.path.relpath(path, ROOT)}:{line}")
    assert not bad, f"os.environ read outside attnext/_env.py (use _env.get): {bad}"


def test_every_setting_is_documented():
    kinds, whens = (_env.PUBLIC, _env.LAB, _env.BUILD, _env.TEST), (_env.CALL, _env.IMPORT, _env.C)
    for name, s in _env.SETTINGS.items():
        assert name == s.name and NAME.fullmatch(name), name
        assert s.kind in kinds and s.when in whens, s
        assert s.type.strip() and s.default.strip() and len(s.doc.split()) >= 3, s
        assert "\n" not in s.type + s.default + s.doc, s                  # one table row
    rows = _env.markdown().splitlines()
    assert len(rows) == 2 + len(_env.SETTINGS)
    assert all(len(re.findall(r"(?<!\\)\|", row)) == 7 for row in rows), rows
    assert set(_env.RUNTIME) == {n for n, s in _env.SETTINGS.items() if s.kind in (_env.PUBLIC, _env.LAB)}


def test_every_variable_named_is_in_the_table():
    named = {}
    for folder, suffixes in (("attnext", (".py",)), ("csrc", (".c", ".h")), ("tests", (".py",)),
                             ("bench/labs", (".py",)), ("kernels", (".cu", ".cuh"))):
        for path in _files(folder, suffixes):
            for name in NAME.findall(open(path, errors="replace").read()):
                if not GUARD.search(name):
                    named.setdefault(name, os.path.relpath(path, ROOT))
    for name in NAME.findall(open(os.path.join(ROOT, "setup.py")).read()):
        named.setdefault(name, "setup.py")
    missing = {n: where for n, where in named.items() if n not in _env.SETTINGS}
    assert not missing, f"ATTNEXT_* variables missing from attnext/_env.py's table: {missing}"


def test_c_and_setup_read_what_the_table_says():
    c_reads = set()
    for path in _files("csrc", (".c", ".h")):
        c_reads |= set(re.findall(r'getenv\("(ATTNEXT_\w+)"\)', open(path).read()))
    assert c_reads == {n for n, s in _env.SETTINGS.items() if s.when == _env.C}
    setup = set(re.findall(r'environ\.get\("(ATTNEXT_\w+)"', open(os.path.join(ROOT, "setup.py")).read()))
    assert setup == {n for n, s in _env.SETTINGS.items() if s.kind == _env.BUILD}


def test_reload_and_setenv(monkeypatch):
    knobs = ("ATTNEXT_BWD_DQ", "ATTNEXT_TILE_SUMS")
    for name in knobs:             # setitem records each one's value, which undo() restores
        monkeypatch.setitem(os.environ, name, "")
        monkeypatch.delenv(name)
    assert _env.values(knobs) == (None, None)
    monkeypatch.setitem(os.environ, "ATTNEXT_BWD_DQ", "atomic")   # a plain write: seen at reload()
    assert _env.get("ATTNEXT_BWD_DQ") is None and _env.values(knobs) == (None, None)
    _env.reload()
    assert _env.get("ATTNEXT_BWD_DQ") == "atomic" and _env.values(knobs) == ("atomic", None)
    _env.setenv("ATTNEXT_TILE_SUMS", "0")
    assert os.environ["ATTNEXT_TILE_SUMS"] == "0" and _env.values(knobs) == ("atomic", "0")
    _env.setenv("ATTNEXT_TILE_SUMS", None)
    assert "ATTNEXT_TILE_SUMS" not in os.environ and _env.values(knobs) == ("atomic", None)
    monkeypatch.setenv("ATTNEXT_BWD_DQ", "ordered")       # conftest.py's monkeypatch reloads
    assert _env.get("ATTNEXT_BWD_DQ") == "ordered"
    with pytest.raises(KeyError):
        _env.get("ATTNEXT_" + "NO_SUCH_SETTING")
    with pytest.raises(KeyError):
        _env.setenv("ATTNEXT_SANITIZE", "1")              # a build variable: not attnext's to set
    monkeypatch.undo()
    assert _env.values(knobs) == tuple(os.environ.get(n) for n in knobs)


def test_a_bad_value_fails_at_the_call_not_at_import(monkeypatch):
    monkeypatch.setenv("ATTNEXT_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="ATTNEXT_NUM_THREADS"):
        attnext.attention(*[__import__("numpy").zeros((1, 2, 1, 8))] * 3, device="cpu")
