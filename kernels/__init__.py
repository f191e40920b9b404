"""The shipped kernels under test: D256 attention, NVFP4 / QPN layouts, gemm routes."""
