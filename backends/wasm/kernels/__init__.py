"""Hand-scheduled WebAssembly kernels the WASM renderer calls for the ops where loop nests alone leave
most of the speed on the table (GEMM and what lowers to it): register tiles, epilogues, and a
standalone runner for testing and benchmarking them outside a full module."""
