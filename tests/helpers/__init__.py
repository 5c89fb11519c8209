"""What the test folders share (tests/ is on sys.path: pyproject's `pythonpath`); no tests here.

- paths: the checkout's folders, a PYTHONPATH for the processes tests start, setup.py's
  functions and constants without a build
- mods: the library of named score_mods and mask_mods with their NumPy twins
- legal_helpers: functions of another module that score_mods and mask_mods call
- bad_inputs: the bad-input battery's tables (contract/test_errors.py; gpu/ feeds them as CUDA
  arrays)
- gpu: NumPy arrays to torch CUDA tensors and back; a call on them against the reference
- host_c: the generated device code built as host C, and run over a grid of pairs or cells
- driver: fresh interpreters, and the fake driver's prelude and runner; a tiny NVRTC kernel
- fake_cuda, fake_libcuda.c: the fake driver (the CUDA host side on host memory) and its build
- cases: option cases every backend is checked on (the lse gradient's and sinks' tests)
- numeric: central differences (the reference's gradients against its forward)
- simd_check.c: csrc/cpu/simd.c's tables checked entry by entry (unit/test_simd_native.py)

conftest.py, at the top of tests/, holds the fixtures and the accuracy checks every folder uses.
"""
