// The example inputs are those of `cortex run --example-inputs` (cortex/commands/run.py:
// example_feeds): floats arange(n) / n rounded once to their type, integers and bools zero.
import assert from "node:assert/strict";
import { test } from "node:test";
import { bfloat16Bits, exampleFeeds, float16Bits } from "../src/examples.js";

// numpy: np.float16(x).view(np.uint16) and ml_dtypes.bfloat16, for these x.
const XS = [0, 0.5, 1 / 3, 2 / 3, 0.999, 1e-6, 3 / 7, 1 / 2048 + 1 / 4096];
const FLOAT16 = [0, 14336, 13653, 14677, 15358, 17, 14043, 4608];
const BFLOAT16 = [0, 16128, 16043, 16171, 16256, 13702, 16091, 14912];

test("half-precision examples round as numpy does", () => {
  assert.deepEqual(XS.map(float16Bits), FLOAT16);
  assert.deepEqual(XS.map(bfloat16Bits), BFLOAT16);
});

test("example feeds: arange(n) / n for floats, zeros otherwise, in the declared shapes", () => {
  const feeds = exampleFeeds([{ name: "x", dtype: "float32", shape: [2, 3] }, { name: "ids", dtype: "int64", shape: [4] },
    { name: "flag", dtype: "bool", shape: [] }]);
  assert.deepEqual([...feeds.x.data], [0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6].map(Math.fround));
  assert.deepEqual([...feeds.x.dims], [2, 3]);
  assert.deepEqual([...feeds.ids.data], [0n, 0n, 0n, 0n]);
  assert.equal(feeds.flag.type, "bool");
  assert.deepEqual([...feeds.flag.dims], []);
  assert.deepEqual([...feeds.flag.data], [0]);
});
