"""The GPU host side: plans and launches (backend), kernel choice and defines (select), NVRTC
(nvrtc), the cubin cache (cache), CUDA arrays (arrays, devview), NumPy staging and pinning,
the captured arrays of score_mod / mask_mod on the device (mod_inputs), process state and its
fork / exit hooks (process), ahead-of-time compiles (warmup), and the keys and recipes of
repeated calls (repeat). Importing this package loads none of them, and `import attnext` loads
only devview and repeat (api.py's, each importing nothing else of the CUDA host side)."""
