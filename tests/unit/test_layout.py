"""The package's shape: no import cycle in attnext/, layers that never reach back up, and the
Python copies of C's layouts (attnext/_layout.py) equal to what csrc/ says, read as text.

The import graph is built with ast from every module under attnext/: each `import attnext.x`,
`from attnext.x import y`, `from . import y` and `from .x import y` (y a module where it is one),
at the top of a module and inside functions alike. A cycle among them fails the test, naming it.
"""
import ast
import os
import re

import attnext
from attnext import _C, _layout

PACKAGE = os.path.dirname(attnext.__file__)
ROOT = os.path.dirname(PACKAGE)
# layers, lowest first: a module may import its own layer's and lower ones' (cuda/ builds on
# mods/, the public modules on both; testing/, bench/ and the torch adapter on everything,
# nothing on them)
LAYERS = [
    {"attnext._C", "attnext._layout", "attnext.lru", "attnext.types", "attnext._env", "attnext._version",
     "attnext.interop"},
    {"attnext.cuda.devview"},
    {"attnext.mods"},
    {"attnext.cuda"},
    {"attnext.reference", "attnext.checks", "attnext.blockmask", "attnext.api", "attnext.merge", "attnext"},
    {"attnext.testing", "attnext.bench", "attnext.warmup", "attnext.fuzz", "attnext.torch", "attnext.hf", "attnext.jax",
     "attnext.distributed"},
]


def _modules():
    """{dotted name: path} of every module under attnext/ (packages as their __init__)."""
    found = {}
    for folder, dirs, files in os.walk(PACKAGE, followlinks=False):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        rel = os.path.relpath(folder, ROOT).replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                name = rel if f == "__init__.py" else f"{rel}.{f[:-3]}"
                found[name] = os.path.join(folder, f)
    return found


def _imports(name, path, modules):
    """The attnext modules that module `name` imports, anywhere in its text."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "attnext"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if base.split(".")[0] != "attnext":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules or sub == "attnext._C" else base)
    out.discard(name)
    return out


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(name):
    for i, layer in enumerate(LAYERS):
        if name in layer or any(name.startswith(p + ".") for p in layer if p != "attnext"):
            return i
    raise AssertionError(f"{name} belongs to no layer of tests/unit/test_layout.py")


def test_no_import_cycle():
    graph = _graph()
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if m not in graph:
                continue
            if state.get(m) == "open":
                cycle = stack[stack.index(m):] + [m]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)


# the one edge that reaches up, inside a function: tracing a captured CUDA array reads its shape
# and dtype through the CUDA array protocols (attnext.cuda.arrays.as_device_view), loaded only
# when a function captures one
REACHES_UP = {("attnext.mods.fingerprint", "attnext.cuda.arrays")}


def test_layers_never_reach_up():
    bad = [f"{a} imports {b}" for a, deps in sorted(_graph().items()) for b in sorted(deps)
           if b != "attnext" and _layer(b) > _layer(a) and (a, b) not in REACHES_UP]
    assert not bad, "\n".join(bad)


def test_dtype_codes_match_attn_params_h():
    text = open(os.path.join(ROOT, "csrc", "attn_params.h")).read()
    enum = re.search(r"typedef enum \{([^}]*)\} attn_dtype;", text).group(1)
    codes = {k.strip(): int(v) for k, v in (e.split("=") for e in enum.split(","))}
    c_names = {"DT_F16": "float16", "DT_BF16": "bfloat16", "DT_F32": "float32", "DT_F64": "float64"}
    assert {c_names[k]: v for k, v in codes.items()} == _layout.DTYPE_CODES


def test_slots_come_from_c_by_name():
    """_layout's slots are _C.layout()'s names, each the attn_params field it fills (the
    X-macro in csrc/cuda/attention.c names both), and every one a slot the backend can take."""
    text = open(os.path.join(ROOT, "csrc", "cuda", "attention.c")).read()
    table = re.search(r"#define PTR_FIELD_LIST\(X\)(.*?)\n#define", text, re.S).group(1)
    pairs = re.findall(r"X\((\w+), ([\w.]+)\)", table)
    assert pairs and all(f.split(".")[0] == name for name, f in pairs)
    assert _layout.PTR_FIELDS == tuple(name for name, _ in pairs) == _C.layout()["ptr_fields"]
    assert len(set(_layout.PTR_FIELDS)) == len(_layout.PTR_FIELDS)


def test_records_carry_every_name_c_reads():
    """Each attribute csrc/module.c and csrc/cuda/attention.c read off the record by name is a field of
    _layout.CpuCall / KernelCall."""
    for path, record in (("module.c", _layout.CpuCall), ("cuda/attention.c", _layout.KernelCall)):
        text = open(os.path.join(ROOT, "csrc", path)).read()
        names = set(re.findall(r"\w+\(prob, \"(\w+)\"", text))
        assert names and names <= set(record.__dataclass_fields__), (path, names - set(record.__dataclass_fields__))
