// Reading dag.json and the files it names: `fetch` for http(s) URLs (browsers, and Node too),
// the file system for paths and file: URLs in Node. Every file is named relative to dag.json.
import { CortexError } from "./errors.js";

const IN_NODE = typeof process !== "undefined" && !!process.versions?.node;

/** The absolute URL of dag.json: a URL as given, a path resolved against the page or the working folder.
 * @param {string | URL} where */
export async function dagUrl(where) {
  if (where instanceof URL) return where;
  if (/^[a-z][a-z0-9+.-]*:/i.test(where) && !/^[a-z]:[\\/]/i.test(where)) return new URL(where);
  if (IN_NODE) {
    const { pathToFileURL } = await import("node:url");
    return pathToFileURL(where);
  }
  return new URL(where, globalThis.location?.href);
}

/** A file named by dag.json, which must stay inside dag.json's folder (as the Python runtime checks).
 * @param {URL} base dag.json's URL @param {string} relative @param {string} owner what names it, for errors */
export function fileUrl(base, relative, owner) {
  if (typeof relative !== "string" || relative.startsWith("/") || relative.split(/[\\/]/).includes("..")
      || /^[a-z][a-z0-9+.-]*:/i.test(relative)) {
    throw new CortexError(`${base.href}: ${owner} names ${JSON.stringify(relative)}, which lies outside its folder`);
  }
  return new URL(relative, base);
}

/** Bytes of a file, or one error naming it. @param {URL} url */
export async function readBytes(url) {
  if (url.protocol === "file:") {
    const [{ readFile }, { fileURLToPath }] = await Promise.all([import("node:fs/promises"), import("node:url")]);
    try {
      const data = await readFile(fileURLToPath(url));
      return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
    } catch (e) {
      throw new CortexError(`cannot read ${fileURLToPath(url)}: ${/** @type {any} */ (e).code ?? e}`);
    }
  }
  return new Uint8Array(await (await fetched(url)).arrayBuffer());
}

/** An http(s) response with a 2xx status, or one error naming the URL. @param {URL} url */
export async function fetched(url) {
  let response;
  try {
    response = await fetch(url);
  } catch (e) {
    throw new CortexError(`cannot fetch ${url.href}: ${/** @type {any} */ (e).message ?? e}`);
  }
  if (!response.ok) throw new CortexError(`cannot fetch ${url.href}: HTTP ${response.status} ${response.statusText}`);
  return response;
}

/** dag.json as an object, or one error naming the file. @param {URL} url */
export async function readJson(url) {
  const text = new TextDecoder().decode(await readBytes(url));
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new CortexError(`${url.href}: not JSON (${/** @type {any} */ (e).message})`);
  }
}
