"""Tools that read a dag and its CUs to calibrate, compare, bisect, reproduce and find crossovers.

None of them is on a request's path: they may import `cortex.runtime`, never the reverse
(tests/test_layering.py holds that). What the runtime reads of their results, such as a
variant's trust in dag.json, it reads with its own code."""
