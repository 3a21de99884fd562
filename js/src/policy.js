// Run policies, as cortex/runtime/policy.py defines them, with the same names, thresholds and
// switches: `strict` runs every CU exactly; `balanced` and `aggressive` skip, cache and run a
// reduced-precision variant whose calibrated trust reaches their threshold, guarded; `offline`
// runs the source model on onnxruntime-web instead of the CUs (js/src/offline.js).
import { CortexError } from "./errors.js";

export const DEFAULT_TRUST_THRESHOLD = 0.99;
export const AGGRESSIVE_TRUST_THRESHOLD = 0.95;

/** @typedef {{name: string, skipInactive: boolean, cache: boolean, trustThreshold: number|null, guards: boolean,
 *             offline: boolean}} Policy */

/** @type {Record<string, Policy>} */
export const POLICIES = {
  strict: { name: "strict", skipInactive: false, cache: false, trustThreshold: null, guards: false, offline: false },
  balanced: { name: "balanced", skipInactive: true, cache: true, trustThreshold: DEFAULT_TRUST_THRESHOLD, guards: true,
    offline: false },
  aggressive: { name: "aggressive", skipInactive: true, cache: true, trustThreshold: AGGRESSIVE_TRUST_THRESHOLD,
    guards: true, offline: false },
  offline: { name: "offline", skipInactive: false, cache: false, trustThreshold: null, guards: false, offline: true },
};
export const DEFAULT_POLICY = "balanced";

/** A policy by name; `trustThreshold` (null: exact CUs only) replaces its threshold, as Python's
 * `Policy.with_threshold` (`cortex run --trust-threshold`) does.
 * @param {string | undefined} name @param {number | null} [trustThreshold] @returns {Policy} */
export function policy(name, trustThreshold) {
  const found = POLICIES[name ?? DEFAULT_POLICY];
  if (!found) throw new CortexError(`unknown policy '${name}': expected one of ${Object.keys(POLICIES).join(", ")}`);
  if (trustThreshold === undefined) return found;
  if (trustThreshold !== null && !(typeof trustThreshold === "number" && trustThreshold >= 0 && trustThreshold <= 1)) {
    throw new CortexError(`trustThreshold must be in [0, 1] (got ${JSON.stringify(trustThreshold)})`);
  }
  return { ...found, trustThreshold };
}
