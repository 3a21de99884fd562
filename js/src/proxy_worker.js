// The Worker of a session created with `proxy: true` (js/src/proxy.js): one InferenceSession, and
// the requests of the thread that started it, one at a time. Ended by that thread's `release()`.
//   {id, create: {url, options, progress}} -> {id, reply: {inputNames, outputNames, inputMetadata, outputMetadata}}
//   {id, run: {feeds, fetches, options}}   -> {id, reply: {outputs, trace, residentBytes}}
//   {id, generate: {ids, options, callbacks}} -> {id, reply: {result, trace, lastGeneration, residentBytes}}
//   any failure                            -> {id, error, cortex}
// Callbacks go the other way: {id, call: name, args}; the Worker waits for {id, returned: name,
// threw?} of onToken (onProgress and onLogits are told without waiting).
import { CortexError } from "./errors.js";
import { InferenceSession } from "./session.js";
import { parentChannel } from "./workers.js";

const channel = await parentChannel();

/** @type {InferenceSession | null} */
let session = null;
/** id -> the settle of the callback the Worker waits for. @type {Map<number, (m: any) => void>} */
const waiting = new Map();

/** @param {any} message @param {Transferable[]} [transfer] */
const post = (message, transfer = []) => channel.post(message, transfer);

/** Tensors as they cross: plain {type, data, dims}. @param {Record<string, any>} tensors */
const plainTensors = (tensors) => Object.fromEntries(Object.entries(tensors)
  .map(([name, t]) => [name, { type: t.type, data: t.data, dims: [...t.dims] }]));

/** Calls a callback option on the calling thread and waits for it; what it threw is thrown here.
 * @param {number} id @param {string} name @param {unknown[]} args */
function called(id, name, args) {
  return new Promise((resolve, reject) => {
    waiting.set(id, (m) => (m.threw === undefined ? resolve(undefined) : reject(new Error(m.threw))));
    post({ id, call: name, args });
  });
}

/** @param {number} id @param {any} request */
async function generated(id, request) {
  const s = /** @type {InferenceSession} */ (session);
  const told = new Set(request.callbacks);
  const options = { ...request.options };
  if (told.has("onLogits")) {
    options.onLogits = (/** @type {Float32Array} */ logits, /** @type {number} */ index) => post({ id, call: "onLogits", args: [logits.slice(), index] });
  }
  if (told.size > 0) options.onToken = (/** @type {number} */ token, /** @type {number} */ index) => called(id, "onToken", [token, index]);
  const result = await s.generate(request.ids, options);
  return { result, trace: s.lastTrace, lastGeneration: s.lastGeneration, residentBytes: s.residentBytes };
}

/** @param {any} m */
async function handle(m) {
  if (m.returned !== undefined) {
    const settle = waiting.get(m.id);
    waiting.delete(m.id);
    settle?.(m);
    return;
  }
  try {
    let reply;
    if (m.create !== undefined) {
      const { url, options, progress } = m.create;
      session = await InferenceSession.create(url, { ...options, proxy: false,
        ...(progress ? { onProgress: (/** @type {any} */ event) => post({ id: m.id, call: "onProgress", args: [event] }) } : {}) });
      reply = { inputNames: session.inputNames, outputNames: session.outputNames,
        inputMetadata: session.inputMetadata, outputMetadata: session.outputMetadata };
    } else if (session === null) {
      throw new CortexError("the session's Worker holds no session");
    } else if (m.run !== undefined) {
      const outputs = await session.run(m.run.feeds, m.run.fetches ?? undefined, m.run.options ?? undefined);
      reply = { outputs: plainTensors(outputs), trace: session.lastTrace, residentBytes: session.residentBytes };
    } else if (m.generate !== undefined) {
      reply = await generated(m.id, m.generate);
    }
    post({ id: m.id, reply });
  } catch (e) {
    post({ id: m.id, error: String(/** @type {any} */ (e)?.message ?? e).split("\n")[0], cortex: e instanceof CortexError });
  }
}

channel.listen(handle);
