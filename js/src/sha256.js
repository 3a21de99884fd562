// SHA-256 through SubtleCrypto (browsers in secure contexts, Node 20 as globalThis.crypto.subtle).
import { CortexError } from "./errors.js";

/** @param {BufferSource} data @returns {Promise<string>} lowercase hex */
export async function sha256Hex(data) {
  return hex(await digest(data));
}

/** @param {BufferSource} data @returns {Promise<ArrayBuffer>} */
export async function digest(data) {
  const subtle = globalThis.crypto?.subtle ?? await nodeSubtle();
  if (!subtle) {
    throw new CortexError("SubtleCrypto is unavailable (a page served over plain http from a host other than "
      + "localhost is not a secure context): serve it over https or from 127.0.0.1");
  }
  return subtle.digest("SHA-256", data);
}

/** @param {ArrayBuffer} buffer */
export function hex(buffer) {
  return Array.from(new Uint8Array(buffer), (b) => b.toString(16).padStart(2, "0")).join("");
}

/** Node 18 has WebCrypto only as node:crypto's `webcrypto`. */
async function nodeSubtle() {
  if (typeof process === "undefined" || !process.versions?.node) return undefined;
  return (await import("node:crypto")).webcrypto?.subtle;
}
