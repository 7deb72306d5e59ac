"""Shared fixtures: tiny random Llama models (milliseconds to build and run)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int, vocab: int = 8, layers: int = 1, hidden: int = 16, scale: float = 25.0, dtype=torch.float64,
               heads: int = 2, kv_heads: int = 1):
    """A random Llama whose next-token distributions are far from uniform (scale widens the logits).

    float64 by default so batched (verify) and one-token (decode) forwards agree
    to ~1e-15 and greedy comparisons are not at the mercy of rounding.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        initializer_range=0.02 * scale,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def perturbed_copy(model, noise: float, seed: int = 123):
    """A draft that agrees with `model` often but not always."""
    import copy

    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(noise * param.std() * torch.randn_like(param))
    return draft


@pytest.fixture(scope="session")
def tiny_pair():
    """(target, draft): two different random models over the same 8-token vocabulary."""
    return tiny_llama(0), tiny_llama(1)


def save_tokenized_pair(root, noise: float = 0.3, kv_heads: int = 1):
    """A tiny random target and a close draft saved with the embedded model's tokenizer (vocab 49152).

    Real tokenizer and chat template, millisecond forwards: what the CLI and serving tests need.
    """
    from specserve.models import load_tokenizer

    tokenizer = load_tokenizer("embedded")
    target = tiny_llama(0, vocab=len(tokenizer), layers=2, hidden=32, scale=8, dtype=torch.float32,
                        heads=2 * kv_heads, kv_heads=kv_heads)
    target.config.eos_token_id = tokenizer.eos_token_id
    draft = perturbed_copy(target, noise)
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.eos_token_id
        model.save_pretrained(str(root / name))
        tokenizer.save_pretrained(str(root / name))
    return root


def start_local_serve(**ray_init) -> dict:
    """A local Ray and Serve for e2e tests: HTTP and gRPC (the Generator service) on free localhost ports.
    Returns their addresses; `stop_local_serve` ends both."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions
    from specserve.serve import GRPC_SERVICER_FUNCTION
    from specserve.serve.listen import free_port

    http_port, grpc_port = free_port(), free_port()
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False, **ray_init)
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=http_port),
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER_FUNCTION]))
    return {"http": f"http://127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}"}


def stop_local_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def batched_and_alone(target, draft, vocab: int, prompt: list[int], sessions: int = 6):
    """Seeded sampling sessions (temperature 1, a model draft, γ from the heuristic controller), each run alone on a
    pool of its own, then all at once sharing one scheduler's steps: (together, alone, the most sessions that
    shared a step)."""
    from concurrent import futures

    from specserve import SamplingParams
    from specserve.engine.loop import speculate
    from specserve.engine.proposers import ModelProposer, TargetVerifier
    from specserve.models.memory.pool import KVPool
    from specserve.scheduler.steps import ScheduledVerifier, StepScheduler
    from specserve.speculation import PositionRNG, make_controller

    def run(seed: int, scheduler, pool) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, ignore_eos=True)
        verifier = ScheduledVerifier(scheduler, TargetVerifier(target, vocab, pool.sequence()))
        rounds = speculate(prompt[seed:] + prompt[:seed], ModelProposer(draft, vocab), verifier, make_controller(2),
                           params, PositionRNG(seed), 12, vocab, set())
        return [t for r in rounds for t in r.tokens]

    def scheduled(expected: int):
        pool = KVPool(target, tokens=1024, min_block=8)
        return StepScheduler(pool, expected=lambda: expected, gather=0.5), pool

    alone = []
    for seed in range(sessions):
        scheduler, pool = scheduled(1)
        try:
            alone.append(run(seed, scheduler, pool))
        finally:
            scheduler.close()
    scheduler, pool = scheduled(sessions)
    try:
        with futures.ThreadPoolExecutor(sessions) as threads:
            together = list(threads.map(lambda seed: run(seed, scheduler, pool), range(sessions)))
        shared = max(scheduler.sessions_per_step)
    finally:
        scheduler.close()
    return together, alone, shared


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process as soon as pytest is done, with its exit status: the interpreter's teardown of the native
    libraries a run loads (Ray's core worker, gRPC, torch's and the kernels' OpenMP runtimes) can crash after every
    test has passed, which says nothing about the code under test. A Ray left initialised is shut down first."""
    if _EXIT_STATUS not in config.stash:
        return
    import os
    import sys

    import ray

    if ray.is_initialized():
        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash[_EXIT_STATUS])
