"""score_mod and mask_mod: the tracer (trace), the structural key (fingerprint), the symbolic
derivative (grad), index bounds (bounds), lowering of band and document masks into the kernels'
own features (lower), the CPU interpreter's programs (interp) and the CUDA C generator (codegen).
Nothing here loads the GPU host side; attnext.cuda builds on it."""
