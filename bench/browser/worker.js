// A module Worker running bench/browser/harness.js's requests, for contestants that need their own
// realm (onnxruntime-web's thread count) or a thread that may block (Cortex's kernel threads).
import { handle } from "./harness.js";

onmessage = async ({ data }) => postMessage(await handle(data));
