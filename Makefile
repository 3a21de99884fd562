# Everything runs inside .venv, created on first use from pyproject.toml.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
OUT    ?= out
SAMPLE ?= samples/cnn.onnx
PYTEST_ARGS ?=

.PHONY: setup demo test test-all test-ray samples conformance bench bench-decompose bench-build bench-runtime bench-sandbox bench-js bench-specializations bench-ray gpu-check gpu-wheels gpu-check-dry-run bench-cuda-scratch clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,cuda]'
	touch $(STAMP)

# The JavaScript runtime's one-file build (js/build.mjs, esbuild pinned by js/package-lock.json), which
# `cortex bundle` adds to a site while it matches js/src; setup makes it where npm is installed.
JS_RUNTIME := js/dist/cortex-runtime.json
JS_DEPS    := js/node_modules/.package-lock.json
$(JS_DEPS): js/package.json js/package-lock.json
	cd js && npm ci --no-audit --no-fund --loglevel=error
$(JS_RUNTIME): $(JS_DEPS) js/build.mjs $(wildcard js/src/*.js)
	cd js && node build.mjs
.PHONY: js-runtime
js-runtime: $(JS_RUNTIME)

setup: $(STAMP) $(if $(shell command -v npm),$(JS_RUNTIME))

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

## onnxruntime-web alone: the JavaScript tests of fallback CUs and the offline policy need it (they skip without it).
.PHONY: ortweb
ortweb: $(ORTWEB)

## Cortex WASM against onnxruntime (native) and onnxruntime-web (after bench-decompose): writes its section of docs/benchmarks.md and $(OUT)/bench.json.
bench: setup $(ORTWEB) bench-decompose bench-js
	$(BIN)/python -m bench.bench_models --json $(OUT)/bench.json
	$(MAKE) bench-ray
	$(MAKE) bench-op-classes
	$(MAKE) bench-narrow-weights
	$(MAKE) bench-nbits-models
	$(MAKE) bench-language-models

## Narrow weights read inside the wasm kernels: the one-row GEMV over B stored f32, bf16 or int8 (GB/s of weight
## bytes against a memory copy's bandwidth) and the 512^3 GEMM (GFLOP/s against float32): its section of docs/benchmarks.md.
.PHONY: bench-narrow-weights
bench-narrow-weights: setup
	$(BIN)/python -m bench.narrow_weights --output docs/benchmarks.md

## 4-bit models: MiniLM and a small Llama-style decoder through onnxruntime's MatMulNBitsQuantizer, Cortex's CU weight
## bytes against the float32 build, latency against onnxruntime and onnxruntime-web, agreement: its section of docs/benchmarks.md.
.PHONY: bench-nbits-models
bench-nbits-models: setup $(ORTWEB)
	$(BIN)/python -m bench.nbits_models --output docs/benchmarks.md --json $(OUT)/nbits-models.json

## Language models: Qwen2.5-0.5B's shape (random weights) int4 by onnxruntime-genai's builder, generating token by token on
## one thread: Cortex wasm (and its JavaScript runtime) against onnxruntime-genai and onnxruntime-web: decode ms per token at
## past 128 and 1024, time to the first token (cold, and with a cached prefix), peak RSS, a memory budget: its section of
## docs/benchmarks.md.
.PHONY: bench-language-models
bench-language-models: setup $(ORTWEB)
	$(BIN)/python -m bench.language_models --output docs/benchmarks.md --json $(OUT)/language-models.json

## The Ray executor on a local loopback cluster: 2 nodes against 1 on a pipelined batch of 64, and the per-hop overhead.
bench-ray: setup
	$(BIN)/python -m bench.bench_ray --output docs/benchmarks.md --json $(OUT)/bench-ray.json

## The JavaScript runtime (js/) against onnxruntime-web in one Node, one thread, over the light models and
## MiniLM, and the bundle's load time against session creation; then in headless Chromium (bench/browser_js.py):
## 1 and 2 threads, cold and warm loads, memory after release: writes its section of docs/benchmarks.md.
bench-js: setup $(ORTWEB) $(JS_RUNTIME)
	$(BIN)/python -m bench.bench_js --json $(OUT)/bench-js.json
## Only the threads section of `make bench`: Cortex on 2 threads (a --wasm-features threads build: each large
## contraction in parts a CU's threads share) against 1 thread and onnxruntime on 2 threads, on the light models,
## MiniLM and a YOLO-style detector, the GIL check and the FMA-peak drift: writes its section of docs/benchmarks.md.
.PHONY: bench-threads
bench-threads: setup
	$(BIN)/python -m bench.threads_bench --output docs/benchmarks.md
## Where a 2-thread run's time goes on shufflenet, squeezenet and MiniLM (default and --parallel 2 builds):
## time with 0, 1 and 2 CUs running, a core starved beside a ready CU, pool hand-offs, the ideal speedup.
.PHONY: profile-threads
profile-threads: setup
	$(BIN)/python -m bench.thread_profile

## The CU runtime: decoding with the result cache (strict vs balanced vs onnxruntime), and the
## reduced-precision variants' bytes, trust, agreement and latency, and memory tiers (vgg19 under a budget
## of 25% of its weights; about 2 GB under .cache/), and the per-CU overhead (chains of 32, 256 and 1024
## tiny CUs, strict and balanced, Python and Node, against onnxruntime), and the runtime's economies (a decoder
## step under strict, balanced and onnxruntime; balanced against strict where no lookup can hit, on every light
## model and MiniLM): writes their sections of docs/benchmarks.md.
bench-runtime: setup
	$(BIN)/python -m bench.bench_runtime --json $(OUT)/bench-runtime.json
	$(BIN)/python -m bench.cu_overhead --output docs/benchmarks.md --json $(OUT)/cu-overhead.json
	$(BIN)/python -m bench.runtime_economies --output docs/benchmarks.md --json $(OUT)/runtime-economies.json

## MiniLM for seq 32,64,128 in one bundle against one build: bytes, warm load with embedded or external weights.
bench-specializations: setup
	$(BIN)/python -m bench.bench_specializations --json $(OUT)/bench-specializations.json

## The same bundle for CUDA (bytes; needs nvcc or NVRTC, no GPU).
.PHONY: bench-specializations-cuda
bench-specializations-cuda: setup
	$(BIN)/python -m bench.bench_specializations --targets cuda --json $(OUT)/bench-specializations-cuda.json

## The integer GEMM kernel alone on MiniLM's products (seq 128): GOPS against the float GEMM, interleaved.
.PHONY: bench-int8-gemm
bench-int8-gemm: setup
	$(BIN)/python -m bench.int8_gemm_bench --shapes minilm

## MiniLM's attention, Softmax, erf GELU and DynamicQuantizeLinear (seq 128) op by op against onnxruntime.
.PHONY: bench-attention-ops
bench-attention-ops: setup
	$(BIN)/python -m bench.attention_ops_bench

## Where whole models lose the FMA peak (vgg19, resnet50, inception_v1, MiniLM seq 128, one thread): time, FLOPs and the
## fraction of the FMA peak or of a copy's bandwidth per op class (3x3/1x1/other/depthwise conv, GEMM by rows, attention,
## elementwise + normalisation, pooling, layout), and each model's fraction of the peak: its section of docs/benchmarks.md.
.PHONY: bench-op-classes
bench-op-classes: setup
	$(BIN)/python -m bench.op_classes --output docs/benchmarks.md --json $(OUT)/op-classes.json

## The CU sandbox's time limit (epoch interruption) on MiniLM: median CPU time with and without it.
bench-sandbox: setup
	$(BIN)/python -m bench.sandbox_overhead --json $(OUT)/bench-sandbox.json

## One shared linear memory per model (compile-wasm --memory shared) against per-CU memories, on
## densenet121 and MiniLM: latency, bytes copied between CUs per inference, resident memory, warm load.
.PHONY: bench-shared-memory
bench-shared-memory: setup
	$(BIN)/python -m bench.shared_memory_bench --json $(OUT)/bench-shared-memory.json

## On a machine with an NVIDIA GPU: compile-cuda + run --device cuda on the samples, light models and
## MiniLM against onnxruntime, timed against onnxruntime's CUDA EP (or torch), plus conformance on cuda;
## writes its section of docs/benchmarks.md. Without a GPU: one line, exit code 2, nothing written.
# On the GPU machine, which has python3 with nvcc, torch, onnx, onnxruntime, cuda-bindings, NVRTC, typer,
# rich, networkx and numpy and no network: no venv; the wheels `make gpu-wheels` fetched beforehand go
# into a folder of their own (no dependencies resolved, nothing from the network), then the check
# runs in under 8 minutes and writes $(OUT)/gpu-check.json and $(OUT)/gpu-check.md.
GPU_PYTHON   ?= python3
GPU_WHEELS   ?= $(OUT)/gpu-wheels
GPU_SITE     ?= $(OUT)/gpu-site
GPU_PACKAGES := 'jsonschema>=4.26,<4.27' 'attrs>=26.1,<26.2' 'referencing>=0.37,<0.38' \
                'jsonschema-specifications>=2025.9,<2025.10' 'rpds-py>=0.30,<2026.10' 'xxhash>=4.1,<4.2' \
                'onnx2torch>=1.5.15,<1.6' 'pytest>=9.2,<9.3' 'iniconfig>=2.3,<2.4' 'pluggy>=1.7,<1.8'
gpu-check:
	$(GPU_PYTHON) -m pip install --quiet --upgrade --no-index --no-deps --find-links $(GPU_WHEELS) --target $(GPU_SITE) $(GPU_PACKAGES)
	PYTHONPATH=$(CURDIR):$(GPU_SITE) $(GPU_PYTHON) -m bench.gpu_check --out $(OUT)/gpu-check \
	  --output $(OUT)/gpu-check.json --markdown $(OUT)/gpu-check.md

## The wheels for gpu-check (about 1.6 MB per Python version): fetched here, carried to the GPU machine.
GPU_PYTHONS ?= 3.10 3.11 3.12 3.13
gpu-wheels: setup
	for v in $(GPU_PYTHONS); do $(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version $$v \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
	  -d $(GPU_WHEELS) $(GPU_PACKAGES) || exit 1; done

## gpu-check's steps on cuda-sim and hybrid-sim with tiny sizes, where there is no GPU.
gpu-check-dry-run: setup
	$(BIN)/python -m bench.gpu_check --dry-run --models mlp --kernel-sizes 32 --repeats 1 \
	  --conformance-cases 'test_relu$$' --out $(OUT)/gpu-check-dry --output $(OUT)/gpu-check-dry.json \
	  --markdown $(OUT)/gpu-check-dry.md

clean:
	rm -rf $(OUT) .cache .pytest_cache

## CUDA scratch space with and without reuse of temporaries (light models, MiniLM); no GPU needed.
bench-cuda-scratch: setup
	$(BIN)/python -m bench.cuda_scratch
