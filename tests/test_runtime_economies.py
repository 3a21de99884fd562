"""bench/runtime_economies.py's no-hit figure holds only if no CU's inputs repeat between requests:
the fresh feeds it draws keep each input's shape, dtype and range, and differ in every input."""

from __future__ import annotations

import numpy as np

from bench.runtime_economies import fresh_feeds


def test_fresh_feeds_differ_in_every_input_and_keep_shape_dtype_and_range():
    seq = 64      # a mask of random bits repeats only once in about 2**32 draws
    ids = np.zeros((1, seq), np.int64)
    ids[0, :4] = 101, 2000, 29999, 102
    mask = (ids != 0).astype(np.int64)
    template = {"image": np.zeros((1, 3, 8, 8), np.float32), "input_ids": ids, "attention_mask": mask,
                "padding": np.zeros((1, seq), bool)}
    feeds = fresh_feeds(template, 20, seed=0)
    for name, value in template.items():
        drawn = [feed[name] for feed in feeds]
        assert all(d.shape == value.shape and d.dtype == value.dtype for d in drawn)
        assert len({d.tobytes() for d in drawn}) == len(drawn), name
    ids = np.stack([feed["input_ids"] for feed in feeds])
    assert ids.min() >= 0 and ids.max() <= 29999
    assert set(np.unique([feed["attention_mask"] for feed in feeds])) == {0, 1}
    images = np.stack([feed["image"] for feed in feeds])
    assert images.min() >= 0.0 and images.max() < 1.0
