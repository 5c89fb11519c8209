"""Tools for checking attention results: the three-way accuracy rule (accuracy) and the
differential fuzzer (fuzz: `python -m attnext.fuzz`)."""
