"""attnext/cuda/process.py: the one fork hook and the one exit hook attnext registers, and the
hooks each module registers with them, run in Python's orders.

Read with ast: no module of attnext/ but process.py calls os.register_at_fork, atexit.register or
threading._register_atexit. Run in fresh processes: the hooks' orders at a fork and at exit, a
hook before the threads are joined cancelling a pool's queued work, and a forked child that
starts with no copy threads, no scratch and fresh locks.
"""
import ast
import os
import subprocess
import sys
import textwrap

import pytest

import attnext

PACKAGE = os.path.dirname(attnext.__file__)
ROOT = os.path.dirname(PACKAGE)
HOOKS = {"register_at_fork", "_register_atexit", "register"}


def _run(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env=env)


def test_hooks_are_registered_in_process_py_alone():
    bad = []
    for base, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        for f in files:
            path = os.path.join(base, f)
            if not f.endswith(".py") or path == os.path.join(PACKAGE, "cuda", "process.py"):
                continue
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in HOOKS and isinstance(node.func.value, ast.Name)
                        and node.func.value.id in ("os", "atexit", "threading")):
                    bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not bad, f"fork / exit hooks registered outside attnext/cuda/process.py: {bad}"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_hooks_in_order_and_a_fresh_child():
    r = _run("""
        import os
        from attnext.cuda import backend, process, staging
        seen = []
        process.at_fork(before=lambda: seen.append("before 1"), after_in_child=lambda: seen.append("child 1"))
        process.at_fork(before=lambda: seen.append("before 2"), after_in_child=lambda: seen.append("child 2"))
        process.at_fork(after_in_child=lambda: 1 / 0)          # reported; the others still run
        process.at_fork(after_in_child=lambda: seen.append("child 3"))
        staging._workers()                                     # copy threads in the parent
        lock = process._scratch_lock
        pid = os.fork()
        if pid == 0:
            ok = (seen == ["before 2", "before 1", "child 1", "child 2", "child 3"]
                  and staging._pool is None and process.scratch_info() == {}
                  and process._scratch_lock is not lock)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0, seen
        assert seen == ["before 2", "before 1"] and staging._pool is not None, seen
        print("ok")
        """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_exit_hooks_in_order_before_and_after_the_thread_join():
    r = _run("""
        import concurrent.futures, threading, time
        from attnext.cuda import process
        pool = concurrent.futures.ThreadPoolExecutor(1)
        started = threading.Event()
        pool.submit(lambda: (started.set(), time.sleep(0.3)))
        queued = pool.submit(lambda: print("queued ran", flush=True))
        started.wait()
        process.at_exit(lambda: print("exit 1", flush=True))
        process.at_exit(lambda: print("exit 2", flush=True))
        process.before_thread_join(lambda: print("join", flush=True))
        process.before_thread_join(lambda: pool.shutdown(wait=False, cancel_futures=True))
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["join", "exit", "2", "exit", "1"], r.stdout     # "queued" never ran
