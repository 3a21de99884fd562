"""The ONNX backend node tests through the whole Cortex pipeline (`make conformance`).

Each case is decomposed with its real input shapes bound, turned into dag.json, compiled for a
device, run with `cortex.load(...).run(...)` and compared with the case's reference outputs under
the backend tests' tolerances. Cases onnxruntime itself cannot reproduce say nothing about Cortex
and leave the denominators; training, string, sequence/optional/map and random cases are out of
scope. `python -m bench.conformance` writes docs/conformance.md and docs/conformance.json.
"""
