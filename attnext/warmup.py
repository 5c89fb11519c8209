"""`python -m attnext.warmup [--arch ARCH] [--check]`: compiles the kernels ahead of time
(attnext/cuda/warmup.py)."""
import sys

from .cuda.warmup import main

if __name__ == "__main__":
    sys.exit(main())
