"""`python -m attnext.fuzz --minutes N`: differential fuzzing of every usable backend against
the reference (attnext/testing/fuzz.py)."""
import sys

from .testing.fuzz import main

if __name__ == "__main__":
    sys.exit(main())
