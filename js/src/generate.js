// Token generation on a language model compiled for it: a cortex.dag/2 dag.json whose sections
// are (new tokens S) x (cache bucket P) specializations of one model with past key/value inputs
// and present outputs. S is input_ids' axis 1 in a section's input_shapes, P a past input's axis 2
// (S = 1 sections decode, larger ones prefill a chunk of the prompt).
//
// The runtime keeps the key/value cache, one Float32Array [1, heads, P, head size] per past input,
// zeros past the L tokens already in it. Each step feeds the whole buffer as the past and copies
// back only the S new rows the model wrote, so a step costs the model's work, not the cache's
// size. Two ways exporters write the cache, told apart by the mask's length in each section:
// - shared buffer (onnxruntime-genai's GroupQueryAttention, mask length P): the mask is 1 for
//   positions < L + S (the operator reads L from its sum) and the new rows are present[:, :, L:L+S];
// - concatenation (standard attention, mask length P + S): the mask is 1 for positions < L and
//   >= P, 0 over the padding between; position_ids (when an input) count L..L+S-1; the new rows
//   are present[:, :, P:P+S].
// `cortex build --kv-buckets` makes present only those S rows (passes/new_cache_rows.py).
// When L + S outgrows the bucket the cache moves to the smallest larger one, by one zero-padded
// copy. The prompt goes in as chunks: the largest chunk size that fits what is left, then smaller
// ones, then single tokens, all in the smallest bucket that holds the whole prompt; the last prompt
// token's logits give the first new token.
//
// The session's prefix cache (js/src/prefix_cache.js) keeps the rows of the prompts' whole chunks of
// the largest size. A prompt restores its cached leading chunks while at least one token is left to
// run (the logits of a chunk are not kept), then runs the rest as it would without the cache. Its
// bucket does not depend on the hit, so a step after a hit sees the same past buffers and feeds as
// the same step without the cache and gives bitwise the same logits (the cached rows themselves
// came from the same steps when the prompt that left them had the same bucket; from another bucket
// they can differ only by the order of the attention's sums over the masked padding).
//
// Sampling is greedy (first largest logit) at temperature 0 or top-k 1; otherwise logits are
// divided by the temperature, cut to the top k, then to the smallest most likely set whose
// probability reaches top-p, and drawn from with mulberry32 seeded by `seed`: a 32-bit generator
// small enough to write out in full here (and in any other runtime that wants the same draws).
import { CortexError, quoted } from "./errors.js";
import { chunkKeys, modelKey, prefixCacheBytes } from "./prefix_cache.js";
import { ARRAY_TYPES, Tensor } from "./tensor.js";

/**
 * @typedef {object} GenerateOptions
 * @property {number} [maxNewTokens] how many tokens to make at most (by default until the largest bucket is full)
 * @property {(id: number, index: number) => unknown} [onToken] called with each token as it is made; a
 *   promise it returns is awaited before the next step (a page yields there to show the token)
 * @property {(logits: Float32Array, index: number) => void} [onLogits] the logits each token is drawn from
 * @property {number} [temperature] 0 (the default) is greedy
 * @property {number} [topK] keep the k most likely tokens (0: all)
 * @property {number} [topP] keep the smallest most likely set whose probability reaches p (1: all)
 * @property {number} [seed] the sampler's seed (0 by default)
 * @property {number[]} [stopIds] a token among these is emitted, then generation ends
 * @property {number} [prefixCacheMB] bounds the session's prefix cache from this call on (0 turns it
 *   off and empties it); `InferenceSession.create` takes the first bound (256 by default)
 */

/** @typedef {{tokens: number, bucket: number}} StepShape a specialization, by the new tokens it takes and its cache's length */

/** How a dag.json's sections serve generation. Throws one CortexError when they cannot. */
export class LanguageModel {
  /** @param {import("./dag.js").Section[]} sections @param {string} where dag.json, for messages */
  constructor(sections, where) {
    const { inputs, outputs } = sections[0].dag;
    const input = (/** @type {string} */ name) => inputs.find((s) => s.name === name);
    const pasts = inputs.filter((s) => s.name.startsWith("past") && s.shape.length === 4);
    if (!input("input_ids") || !input("attention_mask") || !pasts.length) {
      throw new CortexError(`${where}: not a language model with a key/value cache (generation needs inputs input_ids, `
        + `attention_mask and past key/values; it has ${inputs.map((s) => quoted(s.name)).join(", ")})`);
    }
    /** past input -> the present output the model writes it to */
    this.caches = pasts.map((past) => {
      const present = [past.name.replace(/^past_key_values/, "present"), past.name.replace(/^past/, "present")]
        .find((name) => outputs.some((s) => s.name === name));
      if (present === undefined) throw new CortexError(`${where}: no present output for ${quoted(past.name)}`);
      return { past: past.name, present };
    });
    const logits = outputs.find((s) => s.name === "logits") ?? outputs.find((s) => !this.caches.some((c) => c.present === s.name));
    if (!logits) throw new CortexError(`${where}: no logits output`);
    this.logits = logits.name;
    this.vocabulary = logits.shape[logits.shape.length - 1];
    this.idsType = /** @type {any} */ (input("input_ids")).dtype;
    this.maskType = /** @type {any} */ (input("attention_mask")).dtype;
    this.positions = input("position_ids") ? "position_ids" : null;
    const [first] = this.caches;
    const shapes = sections.map((section) => {
      const tokens = section.input_shapes.input_ids[1];
      const bucket = section.input_shapes[first.past][2];
      const mask = section.input_shapes.attention_mask[1];
      const written = /** @type {any} */ (section.dag.outputs.find((s) => s.name === first.present)).shape[2];
      const whole = mask === bucket ? bucket : bucket + tokens;
      if ((mask !== bucket && mask !== bucket + tokens) || (written !== whole && written !== tokens)) {
        throw new CortexError(`${where}: specialization ${section.name ?? "(the only one)"}: attention_mask has length `
          + `${mask} and ${first.present} ${written}: not a step over a past of ${bucket} and ${tokens} new tokens`);
      }
      // `cortex build --kv-buckets` outputs only the step's rows (present as long as the new tokens)
      return { tokens, bucket, shared: mask === bucket, rowsOnly: written === tokens };
    });
    if (new Set(shapes.map((s) => s.shared)).size > 1) {
      throw new CortexError(`${where}: the specializations disagree on whether present shares the past's buffer`);
    }
    /** Whether the mask spans the past's buffer, the new rows written into it (else past and new rows concatenated). */
    this.shared = shapes[0].shared;
    /** Whether present holds only the step's new rows. */
    this.rowsOnly = shapes[0].rowsOnly;
    /** @type {StepShape[]} */
    this.shapes = shapes.map(({ tokens, bucket }) => ({ tokens, bucket }));
    const [, heads, , width] = sections[0].input_shapes[first.past];
    this.rowShape = { heads, width };
    this.largestBucket = Math.max(...this.shapes.map((s) => s.bucket));
    /** The prefill length whose chunks key the prefix cache (0: the model decodes only). */
    this.largestChunk = Math.max(0, ...this.shapes.map((s) => s.tokens).filter((n) => n > 1));
    if (!this.shapes.some((s) => s.tokens === 1 && s.bucket === this.largestBucket)) {
      throw new CortexError(`${where}: no one-token specialization with the largest cache (${this.largestBucket}); `
        + "generation decodes one token a step");
    }
  }

  /** The step for `tokens` new tokens with `length` in the cache, on a bucket at least `bucket`:
   * the smallest that holds them. @param {number} tokens @param {number} length @param {number} bucket */
  step(tokens, length, bucket) {
    const fits = this.shapes.filter((s) => s.tokens === tokens && s.bucket >= Math.max(bucket, length + tokens));
    return fits.sort((a, b) => a.bucket - b.bucket)[0];
  }

  /** The smallest bucket that holds `length` tokens. @param {number} length */
  bucketFor(length) {
    return Math.min(...this.shapes.map((s) => s.bucket).filter((b) => b >= length));
  }

  /** The prefill step for the `left` prompt tokens still to feed: the largest chunk that fits. @param {number} left
   * @param {number} length @param {number} bucket */
  prefillStep(left, length, bucket) {
    const sizes = [...new Set(this.shapes.map((s) => s.tokens))].filter((n) => n <= left).sort((a, b) => b - a);
    for (const tokens of sizes) {
      const found = this.step(tokens, length, bucket);
      if (found) return found;
    }
    throw new CortexError(`no specialization holds ${length + 1} tokens (the largest cache holds ${this.largestBucket})`);
  }
}

/** @type {WeakMap<object, LanguageModel>} one per session */
const models = new WeakMap();

/** The session's language model, worked out once. @param {import("./session.js").InferenceSession} session */
export function languageModel(session) {
  let model = models.get(session);
  if (model === undefined) {
    model = new LanguageModel(session.sections, session.url.href);
    models.set(session, model);
  }
  return model;
}

/** Whether `session` can generate. @param {import("./session.js").InferenceSession} session */
export function isLanguageModel(session) {
  try {
    languageModel(session);
    return true;
  } catch (e) {
    if (e instanceof CortexError) return false;
    throw e;
  }
}

/** Copies `tokens` rows per head from row `sourceFrom` of `source` (`sourceRows` rows a head) to row
 * `targetFrom` of `target` (`targetRows` a head); a row is `width` floats.
 * @param {Float32Array} target @param {number} targetRows @param {number} targetFrom @param {Float32Array} source
 * @param {number} sourceRows @param {number} sourceFrom @param {number} tokens @param {{heads: number, width: number}} rowShape */
function copyRows(target, targetRows, targetFrom, source, sourceRows, sourceFrom, tokens, { heads, width }) {
  for (let h = 0; h < heads; h++) {
    const start = (h * sourceRows + sourceFrom) * width;
    target.set(source.subarray(start, start + tokens * width), (h * targetRows + targetFrom) * width);
  }
}

/** The key/value cache: one buffer per past input, L tokens in it, the current bucket P. */
class KvCache {
  /** @param {LanguageModel} model */
  constructor(model) {
    this.model = model;
    this.length = 0;
    this.bucket = 0;
    /** @type {Map<string, Float32Array>} past input -> [1, heads, bucket, width] */
    this.buffers = new Map(model.caches.map((c) => [c.past, new Float32Array(0)]));
  }

  /** Moves to a larger bucket: one copy of each buffer, zero-padded. @param {number} bucket */
  grow(bucket) {
    const { rowShape } = this.model;
    for (const [name, old] of this.buffers) {
      const grown = new Float32Array(rowShape.heads * bucket * rowShape.width);
      copyRows(grown, bucket, 0, old, this.bucket, 0, this.length, rowShape);
      this.buffers.set(name, grown);
    }
    this.bucket = bucket;
  }

  /** The past feeds: the buffers themselves, not copies. */
  feeds() {
    const { heads, width } = this.model.rowShape;
    return Object.fromEntries([...this.buffers].map(([name, data]) => [name, new Tensor("float32", data, [1, heads, this.bucket, width])]));
  }

  /** Copies the `tokens` new rows the step wrote (from row `from` of each present) to rows L.., then L += tokens.
   * @param {Record<string, Tensor>} results @param {number} from @param {number} tokens */
  append(results, from, tokens) {
    for (const { past, present } of this.model.caches) {
      const source = results[present];
      copyRows(/** @type {Float32Array} */ (this.buffers.get(past)), this.bucket, this.length,
        /** @type {Float32Array} */ (source.data), source.dims[2], from, tokens, this.model.rowShape);
    }
    this.length += tokens;
  }

  /** Copies of rows `start`..`end` of every buffer, [heads, end - start, width] each: a prefix cache entry.
   * @param {number} start @param {number} end @returns {import("./prefix_cache.js").ChunkRows} */
  rows(start, end) {
    const { rowShape } = this.model;
    return new Map([...this.buffers].map(([name, data]) => {
      const rows = new Float32Array(rowShape.heads * (end - start) * rowShape.width);
      copyRows(rows, end - start, 0, data, this.bucket, start, end - start, rowShape);
      return [name, rows];
    }));
  }

  /** Writes a chunk of `tokens` rows, as `rows` copies them out, to rows L.., then L += tokens.
   * @param {import("./prefix_cache.js").ChunkRows} rows @param {number} tokens */
  restore(rows, tokens) {
    for (const [name, data] of rows) {
      copyRows(/** @type {Float32Array} */ (this.buffers.get(name)), this.bucket, this.length, data, tokens, 0, tokens,
        this.model.rowShape);
    }
    this.length += tokens;
  }
}

/** @type {WeakMap<object, Promise<Uint8Array>>} the prefix cache's key_0, one per session */
const modelKeys = new WeakMap();

/** @param {any} session */
function modelKeyOf(session) {
  let key = modelKeys.get(session);
  if (key === undefined) {
    key = modelKey(session.document);
    modelKeys.set(session, key);
  }
  return key;
}

/** A typed array of `type` (an integer dtype) holding `values`. @param {string} type @param {number[]} values */
function integers(type, values) {
  const wide = type === "int64" || type === "uint64";
  return new Tensor(type, /** @type {any} */ (ARRAY_TYPES[type]).from(values, wide ? BigInt : Number), [1, values.length]);
}

/** Runs `ids` through one step and returns the last one's logits (a copy). @param {any} session
 * @param {LanguageModel} model @param {KvCache} cache @param {number[]} ids @param {StepShape} shape */
async function runStep(session, model, cache, ids, shape) {
  if (shape.bucket !== cache.bucket) cache.grow(shape.bucket);
  const { length } = cache, tokens = ids.length, bucket = cache.bucket;
  const mask = Array.from({ length: model.shared ? bucket : bucket + tokens },
    (_, i) => (model.shared ? i < length + tokens : i < length || i >= bucket) ? 1 : 0);
  /** @type {Record<string, Tensor>} */
  const feeds = { input_ids: integers(model.idsType, ids), attention_mask: integers(model.maskType, mask), ...cache.feeds() };
  if (model.positions) feeds[model.positions] = integers(model.idsType, ids.map((_, i) => length + i));
  const results = await session.run(feeds, [model.logits, ...model.caches.map((c) => c.present)]);
  cache.append(results, model.rowsOnly ? 0 : model.shared ? length : bucket, tokens);
  const logits = results[model.logits].data;
  return Float32Array.from(logits.subarray(logits.length - model.vocabulary));
}

/** mulberry32: 32 bits of state, a uniform draw in [0, 1) per call. @param {number} seed */
export function mulberry32(seed) {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** The next token from `logits` (see the module's comment). @param {Float32Array} logits
 * @param {{temperature: number, topK: number, topP: number}} sampling @param {() => number} random */
export function sampleToken(logits, { temperature, topK, topP }, random) {
  if (temperature === 0 || topK === 1) {
    let best = 0;
    for (let i = 1; i < logits.length; i++) if (logits[i] > logits[best]) best = i;
    return best;
  }
  const order = Array.from(logits.keys()).sort((a, b) => logits[b] - logits[a] || a - b);
  const kept = topK > 0 ? order.slice(0, topK) : order;
  const weights = kept.map((i) => Math.exp((logits[i] - logits[kept[0]]) / temperature));
  const total = weights.reduce((a, b) => a + b, 0);
  let count = 0, mass = 0;
  while (count < kept.length && mass < topP * total) mass += weights[count++];
  let draw = random() * mass;
  for (let k = 0; k < count - 1; k++) {
    draw -= weights[k];
    if (draw < 0) return kept[k];
  }
  return kept[count - 1];
}

/** @param {any} value @param {string} name @param {number} least */
function wholeNumber(value, name, least) {
  if (!Number.isInteger(value) || value < least) throw new CortexError(`${name} must be a whole number, at least ${least} (got ${JSON.stringify(value)})`);
  return value;
}

/** The options, checked, with their defaults. @param {GenerateOptions} options @param {number} promptLength @param {LanguageModel} model */
function checkedOptions(options, promptLength, model) {
  const room = model.largestBucket - promptLength + 1;
  const maxNewTokens = wholeNumber(options.maxNewTokens ?? room, "maxNewTokens", 1);
  if (maxNewTokens > room) {
    throw new CortexError(`a prompt of ${promptLength} tokens and maxNewTokens ${maxNewTokens} need a cache of `
      + `${promptLength + maxNewTokens - 1} positions; the largest the model was compiled for holds ${model.largestBucket}`);
  }
  const temperature = options.temperature ?? 0;
  if (typeof temperature !== "number" || !(temperature >= 0) || temperature === Infinity) {
    throw new CortexError(`temperature must be a number, at least 0 (got ${JSON.stringify(temperature)})`);
  }
  const topP = options.topP ?? 1;
  if (typeof topP !== "number" || !(topP > 0 && topP <= 1)) throw new CortexError(`topP must be in (0, 1] (got ${JSON.stringify(topP)})`);
  const stopIds = new Set(options.stopIds ?? []);
  for (const id of stopIds) wholeNumber(id, "each stop id", 0);
  return { maxNewTokens, temperature, topK: wholeNumber(options.topK ?? 0, "topK", 0), topP,
    seed: wholeNumber(options.seed ?? 0, "seed", 0), stopIds,
    prefixCacheBytes: options.prefixCacheMB === undefined ? null : prefixCacheBytes(options.prefixCacheMB) };
}

/** @param {any} ids @param {LanguageModel} model @returns {number[]} */
function checkedPrompt(ids, model) {
  if (!Array.isArray(ids) && !ArrayBuffer.isView(ids)) throw new CortexError("the prompt must be a list of token ids");
  const prompt = Array.from(/** @type {ArrayLike<number | bigint>} */ (ids), Number);
  if (!prompt.length) throw new CortexError("the prompt is empty: generation needs at least one token id");
  const bad = prompt.findIndex((id) => !Number.isInteger(id) || id < 0 || id >= model.vocabulary);
  if (bad >= 0) {
    throw new CortexError(`token id ${String(/** @type {any} */ (ids)[bad])} (at ${bad}) is outside the vocabulary of ${model.vocabulary}`);
  }
  if (prompt.length > model.largestBucket) {
    throw new CortexError(`the prompt has ${prompt.length} tokens; the largest cache the model was compiled for holds ${model.largestBucket}`);
  }
  return prompt;
}

/**
 * New token ids after `ids`, made one at a time on `session` (an InferenceSession of a language
 * model, see the module's comment). `session.lastGeneration` then says how it ran: each step's
 * tokens and bucket (restored prefix chunks are not steps), the prompt tokens the prefix cache
 * restored, the cache's counts, the milliseconds to the first token and per decoded token.
 * @param {any} session @param {ArrayLike<number>} ids @param {GenerateOptions} [options] @returns {Promise<number[]>}
 */
export async function generate(session, ids, options = {}) {
  const model = languageModel(session);
  const prompt = checkedPrompt(ids, model);
  const settings = checkedOptions(options, prompt.length, model);
  /** @type {import("./prefix_cache.js").PrefixCache} */
  const prefixes = session.prefixCache;
  if (settings.prefixCacheBytes !== null) prefixes.resize(settings.prefixCacheBytes);
  const cache = new KvCache(model);
  const started = performance.now();
  cache.grow(model.bucketFor(prompt.length));
  const chunk = model.largestChunk;
  const keys = prefixes.enabled && chunk > 0 ? await chunkKeys(await modelKeyOf(session), prompt, chunk) : [];
  for (const key of keys.slice(0, Math.floor((prompt.length - 1) / chunk))) {
    const rows = prefixes.rows(key);
    if (rows === undefined) break;
    cache.restore(rows, chunk);
  }
  const prefixHitTokens = cache.length;
  const steps = [];
  let logits = new Float32Array(0);
  while (cache.length < prompt.length) {
    const start = cache.length;
    const shape = model.prefillStep(prompt.length - start, start, cache.bucket);
    logits = await runStep(session, model, cache, prompt.slice(start, start + shape.tokens), shape);
    steps.push({ tokens: shape.tokens, bucket: shape.bucket });
    if (shape.tokens === chunk && start % chunk === 0 && start / chunk < keys.length) {
      prefixes.keep(keys[start / chunk], cache.rows(start, start + chunk));
    }
  }
  const record = { steps, prefixHitTokens, prefixCache: prefixes.stats(), ttft_ms: performance.now() - started,
    decode_ms: /** @type {number[]} */ ([]) };
  session.lastGeneration = record;
  const random = mulberry32(settings.seed);
  /** @type {number[]} */
  const made = [];
  for (let index = 0; ; index++) {
    options.onLogits?.(logits, index);
    const id = sampleToken(logits, settings, random);
    made.push(id);
    await options.onToken?.(id, index);
    if (made.length === settings.maxNewTokens || settings.stopIds.has(id)) return made;
    const shape = /** @type {StepShape} */ (model.step(1, cache.length, cache.bucket));
    const stepStarted = performance.now();
    logits = await runStep(session, model, cache, [id], shape);
    record.decode_ms.push(performance.now() - stepStarted);
    steps.push({ tokens: 1, bucket: shape.bucket });
  }
}
