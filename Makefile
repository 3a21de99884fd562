# Everything runs inside .venv, created on first use from pyproject.toml.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
OUT    ?= out
SAMPLE ?= samples/cnn.onnx
PYTEST_ARGS ?=

.PHONY: setup demo test test-all test-ray samples conformance bench bench-decompose bench-build bench-runtime bench-sandbox bench-js bench-specializations bench-ray gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,cuda]'
	touch $(STAMP)

setup: $(STAMP)

## Run every pipeline stage that exists on a bundled sample model and print a summary.
demo: setup
	$(BIN)/python -m cortex.demo $(SAMPLE) --out $(OUT)

## The default test run (slow suites excluded; see test-all).
test: setup
	$(BIN)/pytest -n 2 -q $(PYTEST_ARGS)

test-all: setup
	$(BIN)/pytest -n 2 -q -m "" $(PYTEST_ARGS)

## The Ray executor's suite, slow tests included, on a local loopback cluster (one process: the cluster is per session).
test-ray: setup
	$(BIN)/pytest -n 0 -q -m "" tests/test_ray.py $(PYTEST_ARGS)

## Every ONNX node test through decompose, build-dag, compile and run on DEVICE (wasm or cuda-sim),
## JOBS cases at a time: writes docs/conformance.md and docs/conformance.json (other devices: conformance-DEVICE.*).
DEVICE ?= wasm
JOBS   ?= 2
conformance: setup
	$(BIN)/python -m bench.conformance --device $(DEVICE) --jobs $(JOBS)

## decompose + build-dag on MiniLM and synthetic 5k/10k/20k-node graphs: the Decompose section of docs/benchmarks.md.
bench-decompose: setup
	$(BIN)/python -m bench.bench_decompose

## cortex build on MiniLM: clean build, unchanged rebuild, one-CU rebuild, --check (prints a table).
bench-build: setup
	$(BIN)/python -m bench.bench_build --json $(OUT)/bench-build.json

## Regenerate the committed sample models and the cached test data (node tests, MiniLM).
samples: setup
	$(BIN)/python samples/make_samples.py --all

# onnxruntime-web for the benchmarks, pinned by bench/ortweb/package-lock.json, in a folder make owns.
ORTWEB := bench/ortweb/node_modules/onnxruntime-web/package.json
$(ORTWEB): bench/ortweb/package.json bench/ortweb/package-lock.json
	cd bench/ortweb && npm ci --no-audit --no-fund --loglevel=error
	touch $(ORTWEB)

## Cortex WASM against onnxruntime (native) and onnxruntime-web (after bench-decompose): writes its section of docs/benchmarks.md and $(OUT)/bench.json.
bench: setup $(ORTWEB) bench-decompose bench-js
	$(BIN)/python -m bench.bench_models --json $(OUT)/bench.json
	$(MAKE) bench-ray

## The Ray executor on a local loopback cluster: 2 nodes against 1 on a pipelined batch of 64, and the per-hop overhead.
bench-ray: setup
	$(BIN)/python -m bench.bench_ray --output docs/benchmarks.md --json $(OUT)/bench-ray.json

## The JavaScript runtime (js/) against onnxruntime-web in one Node, one thread, over the light models and
## MiniLM, and the bundle's load time against session creation: writes its section of docs/benchmarks.md.
bench-js: setup $(ORTWEB)
	$(BIN)/python -m bench.bench_js --json $(OUT)/bench-js.json
## Only the threads section of `make bench`: Cortex on 2 threads (decompose --parallel 2) against 1 thread
## and onnxruntime on 2 threads, the GIL check and the FMA-peak drift: writes its section of docs/benchmarks.md.
.PHONY: bench-threads
bench-threads: setup
	$(BIN)/python -m bench.threads_bench --output docs/benchmarks.md

## The CU runtime: decoding with the result cache (strict vs balanced vs onnxruntime), and the
## reduced-precision variants' bytes, trust, agreement and latency, and memory tiers (vgg19 under a budget
## of 25% of its weights; about 2 GB under .cache/): writes their sections of docs/benchmarks.md.
bench-runtime: setup
	$(BIN)/python -m bench.bench_runtime --json $(OUT)/bench-runtime.json

## MiniLM for seq 32,64,128 in one bundle against one build: bytes, warm load with embedded or external weights.
bench-specializations: setup
	$(BIN)/python -m bench.bench_specializations --json $(OUT)/bench-specializations.json

bench-runtime: setup
	$(BIN)/python -m bench.bench_runtime --json $(OUT)/bench-runtime.json

## The CU sandbox's time limit (epoch interruption) on MiniLM: median CPU time with and without it.
bench-sandbox: setup
	$(BIN)/python -m bench.sandbox_overhead --json $(OUT)/bench-sandbox.json

## On a machine with an NVIDIA GPU: compile-cuda + run --device cuda on the samples, light models and
## MiniLM against onnxruntime, timed against onnxruntime's CUDA EP (or torch), plus conformance on cuda;
## writes its section of docs/benchmarks.md. Without a GPU: one line, exit code 2, nothing written.
gpu-check: setup
	$(BIN)/python -m bench.gpu_check --out $(OUT)/gpu-check --output $(OUT)/gpu-check.json

clean:
	rm -rf $(OUT) .cache .pytest_cache
