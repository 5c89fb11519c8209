"""`python -m attnext.bench`: see attnext/bench/cli.py."""
import sys

from .cli import main

sys.exit(main())
