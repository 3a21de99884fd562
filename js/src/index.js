// cortex-runtime: run a Cortex-compiled model (dag.json + one WebAssembly module per computation
// unit) in browsers and Node, with onnxruntime-web's API.
export { InferenceSession } from "./session.js";
export { Tensor } from "./tensor.js";
export { CortexError } from "./errors.js";
export { exampleFeeds } from "./examples.js";
export { isLanguageModel } from "./generate.js";
export { POLICIES } from "./policy.js";
export { DEFAULT_CACHE_BYTES } from "./cache.js";
