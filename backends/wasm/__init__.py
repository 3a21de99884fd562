"""The WebAssembly backend: loop nests -> WAT (SIMD128) -> .wasm, and a wasmtime device to run them."""
