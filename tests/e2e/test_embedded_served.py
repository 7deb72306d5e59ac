"""The embedded default pair served with the defaults (`specserve serve` without flags but a fixed γ): the
quantized target and the distilled draft, bf16 on specserve's CPU kernels where they run (the AVX2 build on
CPUs without AVX-512: `SPECSERVE_CPU_ISA`). The served promises of docs/library.md, on real models, real Ray
and Serve and the `openai` client: a seeded stream's text does not depend on who else is served nor on a kill
of the target worker mid-stream, and greedy speculation emits target-only's text."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest
from ray import serve

from specserve import SamplingParams, SpeculativeDecoder
from specserve.serve import build_app
from tests.conftest import start_local_serve, stop_local_serve

pytestmark = pytest.mark.slow

PROMPTS = ["Explain photosynthesis in two sentences.", "Write a haiku about the sea.",
           "Give three tips for a job interview.", "What is a hash table?"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server():
    addresses = start_local_serve()
    serve.run(build_app({"target": "embedded", "gamma": 3, "model_name": "smol"}), name="embedded",
              route_prefix="/")
    yield {**addresses, "app": serve.get_app_handle("embedded")}
    stop_local_serve()


def _chat(server, prompt: str, seed: int | None, temperature: float = 0.8) -> str:
    client = openai.OpenAI(base_url=f"{server['http']}/v1", api_key="-", max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, stream=True,
        temperature=temperature, seed=seed, extra_body={"ignore_eos": True})
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def _together(server, jobs: list[tuple[str, int]]) -> list[str]:
    out: list[str | None] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = _chat(server, *jobs[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert not errors, errors
    return out


@pytest.fixture(scope="module")
def alone(server) -> dict[tuple[str, int], str]:
    """Four seeded streams (T=0.8, γ=3), each alone on the server."""
    return {(p, 100 + i): _chat(server, p, 100 + i) for i, p in enumerate(PROMPTS)}


def test_seeded_streams_alone_equal_the_same_beside_twelve_others(server, alone):
    others = [(PROMPTS[i % 4], 500 + i) for i in range(12)]
    together = _together(server, list(alone) + others)
    assert together[:4] == list(alone.values())
    assert len(set(together)) > 4  # the others were real, different streams


def test_seeded_streams_go_on_unchanged_across_a_kill_of_the_target_worker(server, alone):
    app = server["app"]
    target = app.process_ids.remote().result(timeout_s=120)["target"]
    jobs = list(alone)[:3]
    results: list[str] = []
    runner = threading.Thread(target=lambda: results.extend(_together(server, jobs)))
    runner.start()
    deadline = time.time() + 120
    while app.worker_sessions.remote().result()["target"] < len(jobs) and time.time() < deadline:
        time.sleep(0.01)  # killed with the sessions on it, mid-stream
    os.kill(target, signal.SIGKILL)
    runner.join(900)
    assert app.process_ids.remote().result(timeout_s=300)["target"] != target
    assert results == [alone[job] for job in jobs]


def test_greedy_speculation_emits_target_only_text(server):
    plain = SpeculativeDecoder("embedded", None, gamma=0)
    for prompt in PROMPTS:
        want = plain.generate([{"role": "user", "content": prompt}],
                              SamplingParams(temperature=0.0, ignore_eos=True), MAX_TOKENS).text
        assert _chat(server, prompt, None, temperature=0.0) == want, prompt
