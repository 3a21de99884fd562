"""The page `cortex bundle` writes for a language model compiled for generation, in headless
Chromium (tests/test_js_browser.py's harness): a prompt-ids box, and the greedy ids shown in the
page one by one as they are made, those onnxruntime's greedy loop makes (as Node's do in
tests/test_js_generate.py)."""

from __future__ import annotations

import json

from cli_helpers import run_cli
from test_js_browser import page_result, served
from test_js_generate import generation_build, natural_greedy, past_shapes, prompt

NEW_TOKENS = 8


def test_the_bundle_page_streams_onnxruntimes_greedy_ids_in_chromium(tmp_path):
    dag = generation_build("int4", (16, 32), (8,))
    ids = prompt(12)
    model = (dag.parent / json.loads(dag.read_text())["source_model"]["path"]).resolve()
    want, _ = natural_greedy(model, ids, NEW_TOKENS, past_shapes(dag))
    site = tmp_path / "site"
    code, _, err = run_cli(["bundle", dag, "--output", site])
    assert code == 0, err
    server = served(site)
    try:
        port = server.server_address[1]
        result, bars = page_result(f"http://127.0.0.1:{port}/index.html?prompt={','.join(map(str, ids))}&tokens={NEW_TOKENS}")
    finally:
        server.shutdown()
        server.server_close()
    assert result["status"] == "done", result.get("error")
    assert result["generated"] == want
    # Each id was added to the page by itself, before the next one was made.
    assert result["streamed"] == [{"id": token, "shown": i + 1} for i, token in enumerate(want)]
    # The prompt (8, then 4 single tokens) and 7 tokens fed back fill 19 positions: 16 in the small bucket.
    steps = [(s["tokens"], s["bucket"]) for s in result["generation"]["steps"]]
    assert steps == [(8, 16)] + [(1, 16)] * 8 + [(1, 32)] * 3
    assert bars == len(result["trace"]["activated_cus"]) > 0
