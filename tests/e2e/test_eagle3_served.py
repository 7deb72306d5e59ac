"""An EAGLE-3 head served in the target worker (`draft: eagle3:PATH`, written in the engines' layout by the test):
it drafts beside the target's pool, and greedy answers are target-only decoding's."""

from __future__ import annotations

import pytest
import requests
from ray import serve
from transformers import AutoModelForCausalLM

from specserve import SamplingParams, SpeculativeDecoder
from specserve.serve import build_app
from tests.conftest import save_tokenized_pair, start_local_serve, stop_local_serve
from tests.eagle3_files import write_eagle3

pytestmark = pytest.mark.slow


def test_a_served_eagle3_head_drafts_and_greedy_is_target_only(tmp_path):
    root = save_tokenized_pair(tmp_path / "models")
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"))
    head = write_eagle3(tmp_path / "head", target, draft_vocab=4096, aux_ids=[0, 0, 0])  # a 2-layer target
    prompts = ["Once upon a time", "The capital of France is"]
    addresses = start_local_serve()
    try:
        serve.run(build_app({"target": str(root / "target"), "draft": f"eagle3:{head}", "dtype": "float32",
                             "gamma": 3, "draft_lookup": False, "model_name": "tiny", "kv_cache_tokens": 4096,
                             "target_resources": {"torch_threads": 1}}), name="eagle", route_prefix="/")
        replies = [requests.post(addresses["http"] + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}).json() for prompt in prompts]
    finally:
        stop_local_serve()
    local = SpeculativeDecoder(str(root / "target"), None, gamma=0, dtype="float32")
    for prompt, reply in zip(prompts, replies):
        assert reply["specserve"]["drafted"] > 0, reply  # the head drafted
        expected = local.generate(prompt, SamplingParams(temperature=0.0, ignore_eos=True), 24)
        assert reply["choices"][0]["text"] == expected.text
