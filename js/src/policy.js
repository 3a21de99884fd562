// Run policies, as cortex/runtime/policy.py defines them. This runtime runs exact CUs only: a
// reduced-precision variant is never picked, so `trust_threshold` plays no part here, and
// `offline` (the source model on onnxruntime) belongs to the Python runtime.
import { CortexError } from "./errors.js";

/** @typedef {{name: string, skipInactive: boolean, cache: boolean}} Policy */

/** @type {Record<string, Policy>} */
export const POLICIES = {
  strict: { name: "strict", skipInactive: false, cache: false },
  balanced: { name: "balanced", skipInactive: true, cache: true },
  aggressive: { name: "aggressive", skipInactive: true, cache: true },
};
export const DEFAULT_POLICY = "balanced";

/** @param {string | undefined} name @returns {Policy} */
export function policy(name) {
  const found = POLICIES[name ?? DEFAULT_POLICY];
  if (!found) {
    const hint = name === "offline" ? " (offline runs the source model: use the Python runtime)" : "";
    throw new CortexError(`unknown policy '${name}': expected one of ${Object.keys(POLICIES).join(", ")}${hint}`);
  }
  return found;
}
