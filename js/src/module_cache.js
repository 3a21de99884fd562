// Fetching and compiling one module file, and keeping compiled modules between sessions and visits
// (`create` option `moduleCache`, on by default). A module is named by the sha256 dag.json records
// for it, so the cache needs no invalidation: a rebuilt module has another key.
// - In this process (browsers and Node): the modules already compiled, held weakly by sha256, so a
//   second session of a model while the first lives compiles and fetches nothing; what no session
//   holds any more is collected with it. Node has no Cache API: this is its whole cache.
// - Between visits (browsers, pages served over http(s)): the Cache API, `caches.open("cortex-modules")`,
//   one entry per module under a synthetic URL holding its sha256, its bytes stored as an
//   application/wasm Response. A later visit compiles with `WebAssembly.compileStreaming` from the
//   cached Response, which lets Chromium reuse the optimised code it keeps beside Cache API entries.
//   A cached entry is not hashed again: its bytes were hashed when they were downloaded, and put
//   only after they matched dag.json's sha256, under a key naming that sha256; the browser checks
//   what it stores (Chromium's cache backend keeps a CRC of each body and fails a read that does not
//   match, which fails the compile here); and the entry carries the header VERIFIED_HEADER, holding
//   the sha256, which only this runtime writes, so an entry that another script of the origin put
//   under the key is not taken for one. An entry without the header, or that does not compile, is
//   dropped and the file fetched (and checked) again. Hashing the ~90 MB of MiniLM's modules again
//   on each visit read every byte into JavaScript and cost a third of a warm load.
// - The cache write of a downloaded module (or weight file) does not hold create up: it waits until
//   create's CUs are instantiated (`ModuleCache.writeHeld`), then goes on while they run
//   (`pendingWrites()` settles when every write has).
// Either cache holds only modules whose bytes matched dag.json.
import { CortexError } from "./errors.js";
import { fetched, readBytes } from "./loader.js";
import { readCounted } from "./progress.js";
import { sha256Hex } from "./sha256.js";

export const MODULE_CACHE_NAME = "cortex-modules";
/** The header of a cache entry this runtime wrote, after the bytes matched: their sha256. */
export const VERIFIED_HEADER = "x-cortex-sha256";

/** Cache writes still under way. @type {Set<Promise<unknown>>} */
const writes = new Set();

/** Settles when every module cache write started so far has (a page about to be left may wait). */
export function pendingWrites() {
  return Promise.all([...writes]).then(() => undefined);
}

/** sha256 -> a module compiled in this process, held weakly. @type {Map<string, WeakRef<WebAssembly.Module>>} */
const compiledModules = new Map();

/** The Cache API key of a module: a URL on the page's origin, which no server is asked for.
 * @param {URL} url where the module is served @param {string} sha256 */
export function moduleCacheKey(url, sha256) {
  return new URL(`/${MODULE_CACHE_NAME}/sha256-${sha256}.wasm`, url.origin).href;
}

/** The Cache API key of a weight file (external weights), as `moduleCacheKey`.
 * @param {URL} url where the file is served @param {string} sha256 */
export function weightsCacheKey(url, sha256) {
  return new URL(`/${MODULE_CACHE_NAME}/sha256-${sha256}.bin`, url.origin).href;
}

/** Tracks a cache write for `pendingWrites`. @param {Promise<unknown>} write */
function tracked(write) {
  writes.add(write);
  write.finally(() => writes.delete(write));
}

export class ModuleCache {
  constructor() {
    /** @type {Promise<Cache | null> | null} */
    this.opened = null;
    /** @type {() => void} */
    let open = () => undefined;
    /** Cache writes wait for this, which `writeHeld` settles once create's CUs are instantiated.
     * Starting the writes of MiniLM's 43 modules (90 MB) takes the page's thread ~300 ms; during a
     * cold create that came on top of the downloads, hashes and compiles create waits on (on 2 cores
     * create took 1.35-1.47 s with them, ~1.0 s without), and a request made right after create
     * now goes before them. */
    this.writesOpen = new Promise((resolve) => { open = resolve; });
    this.openWrites = open;
  }

  /** Lets the writes held so far, and every later one, go ahead, in a later task. */
  writeHeld() {
    setTimeout(this.openWrites, 0);
  }

  /** The Cache API store, where there is one (not in Node, nor in a page that is not a secure
   * context); null otherwise. @param {URL} url */
  storage(url) {
    if (!/^https?:$/.test(url.protocol) || typeof globalThis.caches?.open !== "function") return Promise.resolve(null);
    if (this.opened === null) this.opened = globalThis.caches.open(MODULE_CACHE_NAME).catch(() => null);
    return this.opened;
  }

  /** A weight file's bytes from the Cache API where this runtime stored them after they matched
   * dag.json (the entry carries their sha256 and has the recorded size); null otherwise, a foreign
   * or short entry dropped. @param {URL} url @param {string} sha256 @param {number} bytes */
  async storedWeights(url, sha256, bytes) {
    const store = await this.storage(url);
    if (store === null) return null;
    const key = weightsCacheKey(url, sha256);
    const hit = await store.match(key).catch(() => undefined);
    if (hit === undefined) return null;
    if (hit.headers.get(VERIFIED_HEADER) === sha256) {
      const data = new Uint8Array(await hit.arrayBuffer());
      if (data.byteLength === bytes) return data;
    }
    await store.delete(key).catch(() => false);
    return null;
  }

  /** Stores a weight file's bytes, which matched dag.json's sha256 (a refusing store only costs
   * the next visit a fetch). @param {URL} url @param {string} sha256 @param {Uint8Array} data */
  storeWeights(url, sha256, data) {
    tracked(this.writesOpen.then(() => this.storage(url)).then((store) => store?.put(weightsCacheKey(url, sha256), new Response(data, {
      headers: { "content-type": "application/octet-stream", [VERIFIED_HEADER]: sha256 } }))).catch(() => undefined));
  }

  /** @param {string} sha256 */
  held(sha256) {
    const module = compiledModules.get(sha256)?.deref();
    if (module === undefined) compiledModules.delete(sha256);
    return module;
  }

  /** @param {string} sha256 @param {WebAssembly.Module} module */
  hold(sha256, module) {
    compiledModules.set(sha256, new WeakRef(module));
  }
}

/** The create option, checked: a ModuleCache, or null when off. @param {unknown} option */
export function moduleCache(option) {
  if (option !== undefined && typeof option !== "boolean") {
    throw new CortexError(`moduleCache must be true or false (got ${JSON.stringify(option) ?? typeof option})`);
  }
  return option === false ? null : new ModuleCache();
}

/** @typedef {{cache: ModuleCache | null, progress: import("./progress.js").LoadProgress | null}} Loads */

/** The module file's sha256 and its compiled module (null when the sha256 is not the recorded one:
 * the caller refuses it). @param {URL} url @param {import("./dag.js").WasmRecord} record
 * @param {string} id the CU, for errors @param {Loads} loads @returns {Promise<[string, WebAssembly.Module | null]>} */
export async function compiledModule(url, record, id, loads) {
  const { cache, progress } = loads;
  const onBytes = (/** @type {number} */ read) => progress?.advance(record.path, read);
  try {
    const held = cache?.held(record.sha256);
    if (held !== undefined) {
      progress?.fileRead(record.path);
      return [record.sha256, held];
    }
    const store = cache === null ? null : await cache.storage(url);
    const key = store === null ? "" : moduleCacheKey(url, record.sha256);
    const hit = store === null ? undefined : await store.match(key);
    if (hit !== undefined) {
      const module = hit.headers.get(VERIFIED_HEADER) === record.sha256
        ? await WebAssembly.compileStreaming(hit).catch(() => null) : null;
      if (module !== null) {
        progress?.fileRead(record.path);
        cache?.hold(record.sha256, module);
        return [record.sha256, module];
      }
      await /** @type {Cache} */ (store).delete(key).catch(() => false);     // not ours, or corrupt: fetched again below
    }
    const [sha, module, bytes] = url.protocol !== "file:" && typeof WebAssembly.compileStreaming === "function"
      ? await compiledStream(await fetched(url), record, onBytes, id, url)
      : await compiledBytes(await readBytes(url), record, onBytes);
    if (sha === record.sha256 && cache !== null) {
      cache.hold(sha, /** @type {WebAssembly.Module} */ (module));
      // A store that refuses (quota, private mode) only costs the next visit a fetch.
      if (store !== null) {
        tracked(cache.writesOpen.then(() => store.put(key, new Response(bytes, { headers: { "content-type": "application/wasm",
          [VERIFIED_HEADER]: sha } }))).catch(() => undefined));
      }
    }
    return [sha, module];
  } catch (e) {
    if (e instanceof CortexError) throw e;
    throw new CortexError(`${url.href}: ${id} does not compile: ${/** @type {any} */ (e).message ?? e}`);
  }
}

/** Compiles while the bytes stream in, hashing a copy of them; the module only when the hash
 * matches (a corrupt file's compile error is not the error to report).
 * @param {Response} response @param {import("./dag.js").WasmRecord} record @param {(read: number) => void} onBytes
 * @param {string} id @param {URL} url @returns {Promise<[string, WebAssembly.Module | null, Uint8Array]>} */
async function compiledStream(response, record, onBytes, id, url) {
  const bytes = readCounted(response.clone(), Number(record.bytes) || 0, onBytes);
  const module = WebAssembly.compileStreaming(response).catch(async (e) => {
    // A server that does not send application/wasm: compile from the bytes instead.
    if (!(e instanceof TypeError)) throw e;
    return WebAssembly.compile(await bytes);
  });
  module.catch(() => undefined);             // awaited below only when the bytes are the recorded ones
  const data = await bytes;
  const sha = await sha256Hex(data);
  if (sha !== record.sha256) return [sha, null, data];
  try {
    return [sha, await module, data];
  } catch (e) {
    throw new CortexError(`${url.href}: ${id} does not compile: ${/** @type {any} */ (e).message ?? e}`);
  }
}

/** @param {Uint8Array} data @param {import("./dag.js").WasmRecord} record @param {(read: number) => void} onBytes
 * @returns {Promise<[string, WebAssembly.Module | null, Uint8Array]>} */
async function compiledBytes(data, record, onBytes) {
  onBytes(data.byteLength);
  const sha = await sha256Hex(data);
  return [sha, sha === record.sha256 ? await WebAssembly.compile(data) : null, data];
}
