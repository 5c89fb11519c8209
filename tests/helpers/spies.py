"""Spies on attnext's host path, for tests that count what a call did."""
import contextlib


@contextlib.contextmanager
def whole_path_calls():
    """A list that grows by one for each call that takes the whole path (checks.normalise), while
    the block runs: repeated calls replayed by attnext/cuda/repeat.py add nothing."""
    from attnext import checks
    calls = []
    normalise = checks.normalise

    def counted(*a, **kw):
        calls.append(1)
        return normalise(*a, **kw)
    checks.normalise = counted
    try:
        yield calls
    finally:
        checks.normalise = normalise
