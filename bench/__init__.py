"""Benchmarks (`make bench`): Cortex's WebAssembly output against onnxruntime (native CPU) and
onnxruntime-web (WebAssembly in Node), on real models and on GEMM micro-benchmarks. The results land
in docs/benchmarks.md, generated, never typed."""
