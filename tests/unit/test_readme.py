"""The README runs as written: its Python blocks run, its shell lines name files and modules that
exist, its set-up and test commands are the ones CI runs (.ci/run), and its links resolve. Nothing
in the repository names a path outside it (a clone has only what the repository holds: the contract is docs/design.md).
"""
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import paths

ROOT = str(paths.ROOT)
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
COMMANDS = ("pip", "python", "pytest")


def _read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def fences(path):
    """[(language, text)] of the fenced blocks of a Markdown file."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(_read(path))]


def shell_lines(path):
    """The lines of a file's non-Python fences that start with pip, python or pytest."""
    return [line.strip() for lang, text in fences(path) if lang != "python"
            for line in text.splitlines() if line.strip().split(" ")[0] in COMMANDS]


def _run(script):
    """script run by this Python in a fresh process at the repository's root, attnext importable."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=path), timeout=120)


def _python_blocks():
    return [text for lang, text in fences("README.md") if lang == "python"]


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_blocks_run(index):
    block = _python_blocks()[index]
    done = _run(block)
    assert done.returncode == 0, f"README block {index} failed:\n{block}\n{done.stderr[-3000:]}"


def test_score_mod_guide_runs():
    """docs/score_mod.md's Python blocks, in order, as one script."""
    script = "\n".join(text for lang, text in fences("docs/score_mod.md") if lang == "python")
    done = _run(script)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("path", ["README.md", "docs/semantics.md", "docs/score_mod.md", "docs/gpu.md"])
def test_docs_shell_lines_name_what_exists(path):
    """Every fenced pip / python / pytest line of the docs runs as written (the README's are
    also checked against .ci/run below)."""
    _check_shell_lines(shell_lines(path))


def test_readme_example_is_examples_score_mod():
    """The README's first example is examples/score_mod.py, line for line."""
    assert _python_blocks()[0] == _read("examples/score_mod.py")


def test_readme_has_shell_lines():
    assert shell_lines("README.md"), "the README has no set-up or test commands"


def _check_shell_lines(lines):
    extras = re.search(r"\[project\.optional-dependencies\](.*?)\n\[", _read("pyproject.toml"), re.S)
    for line in lines:
        words = shlex.split(line.split(" #")[0])
        assert "<" not in line and "..." not in line, f"a placeholder in a fenced command: {line}"
        if words[0] == "pip":
            for word in words[2:]:
                for extra in re.findall(r"\[([\w,]+)\]", word):
                    for name in extra.split(","):
                        assert re.search(rf"^{name} =", extras.group(1), re.M), (line, name)
        elif words[:2] == ["python", "-m"]:
            if words[2] != "pip":
                assert importlib.util.find_spec(words[2]) is not None, line
        elif words[0] == "python":
            assert os.path.isfile(os.path.join(ROOT, words[1])), line


def test_readme_commands_are_what_ci_runs():
    """.ci/run runs the README's set-up and test commands, in the README's order."""
    ci = [line.strip() for line in _read(".ci/run").splitlines()]
    positions = []
    for line in shell_lines("README.md")[:4]:
        assert line in ci, f"README's {line!r} is not in .ci/run"
        positions.append(ci.index(line))
    assert positions == sorted(positions)


@pytest.mark.parametrize("path", ["README.md", "CHANGELOG.md", "docs/design.md", "docs/semantics.md",
                                  "docs/score_mod.md", "docs/gpu.md"])
def test_links_resolve(path):
    base = os.path.dirname(os.path.join(ROOT, path))
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _read(path)):
        if re.match(r"\w+://", target):
            continue
        assert os.path.exists(os.path.join(base, target)), f"{path}: link to {target} goes nowhere"


# the names, in pieces so that this file does not name them itself: the folder beside the
# checkout, the machine's work folder, and the two documents that live there
OUTSIDE = re.compile("|".join(re.escape(a + b) for a, b in (
    ("../", "shared"), ("/wo", "rk/"))) + r"|\b(DESIGN|STYLE)\.md")


def _tracked():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out if not p.startswith("bench/results/")
            and p.endswith((".py", ".md", ".c", ".h", ".cu", ".cuh", ".toml", ".sh", ".txt"))]


def test_nothing_names_a_path_outside_the_repository():
    bad = []
    for path in _tracked():
        if os.path.islink(os.path.join(ROOT, path)) or not os.path.isfile(os.path.join(ROOT, path)):
            continue
        for n, line in enumerate(_read(path).splitlines(), 1):
            if OUTSIDE.search(line):
                bad.append(f"{path}:{n}: {line.strip()[:80]}")
    assert not bad, "\n".join(bad)
