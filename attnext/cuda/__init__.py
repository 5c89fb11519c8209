"""The GPU host side: plans and launches (backend), kernel choice and defines (select), NVRTC
(nvrtc), the cubin cache (cache), CUDA arrays (arrays, devview), NumPy staging and pinning,
the captured arrays of score_mod / mask_mod on the device (mod_inputs), process state and its
fork / exit hooks (process), and ahead-of-time compiles (warmup). Importing this package loads
none of them: `import attnext` never loads the CUDA host side."""
