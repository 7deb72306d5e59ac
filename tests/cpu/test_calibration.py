"""`auto`'s calibration kept on disk (`engine.calibration`): measured once for a pair of model files loaded one
way on one machine, read back by the next worker; a changed file, another load, a damaged entry or the switch
measure again."""

from __future__ import annotations

import os

import pytest

from specserve.engine import calibration
from specserve.rpc.servicers import TargetWorkerServicer
from tests.conftest import perturbed_copy, tiny_llama

LOADED = {"dtype": "bfloat16", "device": "cpu", "quantization": "gguf-Q4_K", "gamma_max": 4}


@pytest.fixture
def pair(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "target.gguf"
    target.write_bytes(b"target weights")
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    (draft / "model.safetensors").write_bytes(b"draft weights")
    return str(target), str(draft)


def counting(costs):
    calls = []

    def measure():
        calls.append(1)
        return costs

    return measure, calls


def test_measured_once_then_read_back_until_a_file_or_the_load_changes(pair, tmp_path):
    target, draft = pair
    measure, calls = counting(({1: 0.010, 2: 0.012, 3: 0.015}, 0.004))
    parts = calibration.identity(target, draft, LOADED, 2)
    assert calibration.cached(parts, measure) == measure() and len(calls) == 2
    assert calibration.cached(calibration.identity(target, draft, LOADED, 2), measure) == measure()
    assert len(calls) == 3  # the second worker read it: one measure() above was this test's own
    assert calibration.cached(calibration.identity(target, draft, {**LOADED, "gamma_max": 8}, 2), measure)
    assert calibration.cached(calibration.identity(target, draft, LOADED, 1), measure)  # other threads
    assert len(calls) == 5
    os.utime(target, ns=(1, 1))  # the file replaced by another of the same name
    calibration.cached(calibration.identity(target, draft, LOADED, 2), measure)
    assert len(calls) == 6 and len(list((tmp_path / "cache" / "calibration").glob("*.json"))) == 4


def test_a_damaged_entry_a_model_passed_loaded_and_the_switch_measure_again(pair, tmp_path, monkeypatch):
    target, draft = pair
    measure, calls = counting(({1: 0.010, 2: 0.012}, None))
    parts = calibration.identity(target, draft, LOADED, 2)
    calibration.cached(parts, measure)
    [entry] = (tmp_path / "cache" / "calibration").glob("*.json")
    for damaged in ("{", '{"verify_s": {"1": 0.01, "3": 0.02}, "draft_token_s": null}',
                    '{"verify_s": {"1": -1}, "draft_token_s": null}'):
        entry.write_text(damaged)
        assert calibration.cached(parts, measure) == measure()
    assert len(calls) == 7 and calibration.cached(parts, measure) == measure() and len(calls) == 8  # replaced
    assert calibration.identity(object(), draft, LOADED, 2) is None  # no files to tell it by
    calibration.cached(None, measure)
    other = calibration.identity(target, draft, LOADED, 7)
    assert calibration.cached(other, lambda: (None, None)) == (None, None)  # nothing measured: nothing saved
    calibration.cached(other, measure)
    monkeypatch.setattr(calibration, "ENABLED", False)
    calibration.cached(parts, measure)
    assert len(calls) == 11


def test_a_colocated_worker_reads_the_calibration_its_predecessor_measured(pair, monkeypatch):
    """The worker's wiring: the second worker with the same files' identity does not time a step."""
    target_spec, draft_spec = pair
    target = tiny_llama(0, vocab=64, layers=2, hidden=32, scale=8)
    draft = perturbed_copy(target, 0.3)

    def worker():
        servicer = TargetWorkerServicer(target, 64, kv_cache_tokens=2048)
        servicer.attach_draft(draft, set(), gamma_max=3)
        servicer.colocated.calibration = calibration.identity(target_spec, draft_spec, LOADED, 1)
        return servicer

    first = worker()
    verify, step = first.colocated.cost_profile()
    first.close()
    assert sorted(verify) == [1, 2, 3, 4] and min(verify.values()) > 0 and step > 0
    from specserve.scheduler import colocated

    def untimed(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(colocated, "verify_profile", untimed)
    monkeypatch.setattr(colocated, "draft_step_time", untimed)
    second = worker()
    try:
        assert second.colocated.cost_profile() == (verify, step)
    finally:
        second.close()
