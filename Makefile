# Everything runs inside .venv, created on first use from pyproject.toml.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
OUT    ?= out
SAMPLE ?= samples/cnn.onnx
PYTEST_ARGS ?=

.PHONY: setup demo test test-all samples conformance bench bench-decompose bench-runtime gpu-check clean

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

## Every ONNX node test through decompose, build-dag, compile and run on DEVICE (wasm or cuda-sim),
## JOBS cases at a time: writes docs/conformance.md and docs/conformance.json (other devices: conformance-DEVICE.*).
DEVICE ?= wasm
JOBS   ?= 2
conformance: setup
	$(BIN)/python -m bench.conformance --device $(DEVICE) --jobs $(JOBS)

## decompose + build-dag on MiniLM and synthetic 5k/10k/20k-node graphs: the Decompose section of docs/benchmarks.md.
bench-decompose: setup
	$(BIN)/python -m bench.bench_decompose

## Regenerate the committed sample models and the cached test data (node tests, MiniLM).
samples: setup
	$(BIN)/python samples/make_samples.py --all

# onnxruntime-web for the benchmarks, pinned by bench/ortweb/package-lock.json, in a folder make owns.
ORTWEB := bench/ortweb/node_modules/onnxruntime-web/package.json
$(ORTWEB): bench/ortweb/package.json bench/ortweb/package-lock.json
	cd bench/ortweb && npm ci --no-audit --no-fund --loglevel=error
	touch $(ORTWEB)

## Cortex WASM against onnxruntime (native) and onnxruntime-web (after bench-decompose): writes its section of docs/benchmarks.md and $(OUT)/bench.json.
bench: setup $(ORTWEB) bench-decompose
	$(BIN)/python -m bench.bench_models --json $(OUT)/bench.json

## The CU runtime: decoding with the result cache (strict vs balanced vs onnxruntime), and the
## reduced-precision variants' bytes, trust, agreement and latency: writes its section of docs/benchmarks.md.
bench-runtime: setup
	$(BIN)/python -m bench.bench_runtime --json $(OUT)/bench-runtime.json

## On a machine with an NVIDIA GPU: compile-cuda + run --device cuda on the samples, light models and
## MiniLM against onnxruntime, timed against onnxruntime's CUDA EP (or torch), plus conformance on cuda;
## writes its section of docs/benchmarks.md. Without a GPU: one line, exit code 2, nothing written.
gpu-check: setup
	$(BIN)/python -m bench.gpu_check --out $(OUT)/gpu-check --output $(OUT)/gpu-check.json

clean:
	rm -rf $(OUT) .cache .pytest_cache

## CUDA scratch space with and without reuse of temporaries (light models, MiniLM); no GPU needed.
bench-cuda-scratch: setup
	$(BIN)/python -m bench.cuda_scratch
