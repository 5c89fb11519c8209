"""The benchmarks users run: `python -m attnext.bench` (cli.py) times attnext against PyTorch and
the reference on the CPU (cpu.py) or the GPU (cuda.py; its score_mod / mask_mod rows: mods.py),
validating every row before timing it. The kernel lab's scripts live in the repository's bench/."""
