"""The data-plane bench (`bench.dataplane`): its synthetic pairs have the acceptance they claim, and it runs the
workers as processes without Ray, end to end, on tiny shapes."""

from __future__ import annotations

import json

import pytest
import torch
from specserve.bench import dataplane
from specserve.bench.dataplane import synthetic_llama

VOCAB = 256


def greedy_next(model, tokens: list[int]) -> list[int]:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].argmax(-1).tolist()


def test_synthetic_pairs_accept_the_share_they_are_built_for():
    tokens = list(range(VOCAB))
    target = greedy_next(synthetic_llama("tiny", VOCAB, None, "cpu", "float32"), tokens)
    assert target == [(t + 1) % VOCAB for t in tokens]  # whatever the context: the successor of the last token
    for alpha in (0.0, 0.5, 1.0):
        draft = greedy_next(synthetic_llama("tiny", VOCAB, alpha, "cpu", "float32"), tokens)
        agree = sum(d == t for d, t in zip(draft, target)) / VOCAB
        assert all(d in ((t + 1) % VOCAB, (t + 2) % VOCAB) for t, d in zip(tokens, draft))
        assert abs(agree - alpha) < 0.1, (alpha, agree)


def test_the_bench_runs_worker_processes_and_reports_exact_output(tmp_path, capsys):
    code = dataplane.main([
        "--targets", "tiny", "--draft-shape", "tiny", "--vocab", str(VOCAB), "--device", "cpu", "--dtype", "float32",
        "--alphas", "1,0", "--gamma", "3", "--prompt-len", "12", "--max-tokens", "16", "--concurrency", "1,3",
        "--parts", "rounds,load", "--out", str(tmp_path),
    ])
    assert code == 0  # every token was the target's greedy output
    report = json.loads((tmp_path / "dataplane.json").read_text())
    configs = {(r["config"], r["alpha"]) for r in report["rounds"]}
    assert configs == {("in-process", 1.0), ("in-process", 0.0), ("in-process", None), ("colocated", 1.0),
                       ("colocated", 0.0), ("served target only", None), ("split sequential", 1.0),
                       ("split pipelined", 1.0), ("split sequential", 0.0), ("split pipelined", 0.0)}
    for row in report["rounds"]:
        assert row["wrong_tokens"] == 0 and row["tokens"] == 16
        if row["gamma"] == 3:  # fixed γ: a copying draft is always accepted, a never-matching one never
            assert row["acceptance"] == row["alpha"], row
        if row["config"] != "in-process":  # served: the worker's compute is part of the verify call
            assert 0 < row["worker_verify_ms_per_round"] <= row["verify_ms_per_round"]
    # side by side per level, the order alternating
    assert [(r["gamma"], r["streams"]) for r in report["load"]] == [(0, 1), ("auto", 1), ("auto", 3), (0, 3)]
    assert all(r["tokens"] == 16 * r["streams"] and r["ttft_p50_s"] > 0 for r in report["load"])
    # the load part's worker start-up: seconds to serving (no step runner on a CPU: nothing to warm up)
    assert [(r["target"], r["warm_up"]) for r in report["startup"]] == [("tiny", None)]
    assert report["startup"][0]["start_s"] > 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "dataplane.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_steps_and_hf_parts_report_floors_and_exact_output(tmp_path):
    code = dataplane.main([
        "--targets", "tiny", "--draft-shape", "tiny", "--vocab", str(VOCAB), "--device", "cpu", "--dtype", "float32",
        "--gamma", "2", "--prompt-len", "12", "--max-tokens", "16", "--concurrency", "1,3",
        "--parts", "steps,accept,hf,gammas",
        "--step-repeats", "3", "--sweep-gammas", "0,2,auto", "--load-alpha", "0.5", "--out", str(tmp_path),
    ])
    assert code == 0
    report = json.loads((tmp_path / "dataplane.json").read_text())
    levels = {(r["mode"], r["sequences"], r["width"]) for r in report["steps"]}
    assert levels == {(mode, n, w) for mode in ("eager", "runner") for n in (1, 3) for w in (1, 3)}
    for row in report["steps"]:
        assert row["step_ms"] > 0 < row["floor_ms"] and row["of_floor"] == pytest.approx(row["step_ms"] / row["floor_ms"])
    assert [r["sequences"] for r in report["accept"]] == [1, 3]
    assert all(r["together_ms"] > 0 < r["one_by_one_ms"] for r in report["accept"])
    assert [r["config"] for r in report["hf"]] == ["hf target-only", "hf assisted"]
    assert all(r["wrong_tokens"] == 0 and r["tokens"] == 16 for r in report["hf"])
    assert [r["gamma"] for r in report["gammas"]] == [0, 2, "auto"]
    assert all(r["wrong_tokens"] == 0 and r["tokens"] == 16 for r in report["gammas"])
    assert report["gammas"][1]["tokens_per_round"] > 1  # γ=2 drafted, and alpha=0.5 accepted some
    assert (tmp_path / "dataplane.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_steps_part_times_compiled_steps_and_names_a_wrong_mode(tmp_path, capsys):
    common = ["--targets", "tiny", "--draft-shape", "tiny", "--vocab", str(VOCAB), "--device", "cpu", "--dtype",
              "float32", "--gamma", "0", "--prompt-len", "12", "--concurrency", "1", "--parts", "steps",
              "--step-repeats", "2", "--out", str(tmp_path)]
    assert dataplane.main(common + ["--step-modes", "compiled,compiled-dynamic"]) == 0
    report = json.loads((tmp_path / "dataplane.json").read_text())
    assert [(r["mode"], r["runner"], r["sequences"], r["width"]) for r in report["steps"]] == [
        ("compiled", True, 1, 1), ("compiled-dynamic", True, 1, 1)]
    with pytest.raises(SystemExit):
        dataplane.main(common + ["--step-modes", "eager,fast"])
    assert "--step-modes: unknown mode(s) ['fast']" in capsys.readouterr().err


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_target_serves_its_greedy_chain_and_reads_fewer_bytes(tmp_path, quantization):
    args = ["--targets", "tiny", "--draft-shape", "tiny", "--vocab", str(VOCAB), "--device", "cpu", "--gamma", "3",
            "--prompt-len", "12", "--max-tokens", "16", "--concurrency", "1", "--parts", "steps,rounds",
            "--alphas", "1", "--step-repeats", "2"]
    assert dataplane.main([*args, "--out", str(tmp_path / "q"), "--quantization", quantization]) == 0
    assert dataplane.main([*args, "--out", str(tmp_path / "dense"), "--dtype", "bfloat16"]) == 0
    quantized, dense = (json.loads((tmp_path / d / "dataplane.json").read_text()) for d in ("q", "dense"))
    assert quantized["args"]["quantization"] == quantization
    assert all(r["wrong_tokens"] == 0 and r["tokens"] == 16 for r in quantized["rounds"])  # in process and served
    ratio = quantized["steps"][0]["weight_bytes"] / dense["steps"][0]["weight_bytes"]
    assert ratio < (0.6 if quantization == "int8" else 0.45), ratio  # the floor counts the packed bytes


@pytest.mark.parametrize("shape,family,params", [
    ("llama3-8b", "llama", 8_030_261_248), ("llama3-1b", "llama", 1_235_814_400),
    ("qwen2.5-7b", "qwen2", 7_615_616_512), ("qwen2.5-0.5b", "qwen2", 494_032_768)])
def test_public_shapes_have_the_public_models_parameter_counts(shape, family, params):
    """The bench's shapes of the pairs users compare with are those models' (counted on the meta device, no
    memory), and the pooled forward takes them."""
    from specserve.bench.dataplane import shape_config
    from specserve.models.families.lean import unsupported_config
    from transformers import AutoModelForCausalLM

    config = shape_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert config.model_type == family and sum(p.numel() for p in model.parameters()) == params
    assert unsupported_config(config) is None


def test_a_qwen2_shaped_synthetic_pair_decodes_its_known_successors():
    """The synthetic construction holds for a Qwen2 (attention biases) as for a Llama: greedy t+1, t+2, ..."""
    from specserve import SamplingParams, SpeculativeDecoder
    from specserve.bench.dataplane import SHAPES, wrong_tokens

    SHAPES["qwen-tiny"] = {**SHAPES["tiny"], "model_type": "qwen2"}
    try:
        target = synthetic_llama("qwen-tiny", VOCAB, None, "cpu", "float32")
        draft = synthetic_llama("qwen-tiny", VOCAB, 0.5, "cpu", "float32")
    finally:
        del SHAPES["qwen-tiny"]
    assert target.config.model_type == "qwen2"
    prompt = [3, 9, 4]
    result = SpeculativeDecoder(target, draft, gamma=3, draft_lookup=False).generate(
        prompt, SamplingParams(temperature=0.0, ignore_eos=True), 20)
    assert wrong_tokens(prompt, result.token_ids, VOCAB) == 0
    assert 0.0 < result.stats.acceptance_rate < 1.0


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_a_synthetic_head_drafts_with_the_set_acceptance(alpha):
    """The synthetic feature head reads the synthetic target's features: greedy output stays t+1, t+2, ...
    and its drafted tokens are accepted at about alpha."""
    from specserve import SamplingParams, SpeculativeDecoder
    from specserve.bench.dataplane import synthetic_head, wrong_tokens

    target = synthetic_llama("tiny", VOCAB, None, "cpu", "float32")
    head = synthetic_head("tiny", VOCAB, alpha, "cpu", "float32")
    prompt = [3, 9, 4]
    result = SpeculativeDecoder(target, head, gamma=1, draft_lookup=False).generate(
        prompt, SamplingParams(temperature=0.0, ignore_eos=True), 120)
    assert wrong_tokens(prompt, result.token_ids, VOCAB) == 0
    assert abs(result.stats.acceptance_rate - alpha) < 0.15


def test_the_head_draft_kind_runs_in_process_and_in_a_target_worker(tmp_path):
    with pytest.raises(SystemExit):
        dataplane.parse_args(["--targets", "tiny", "--draft-kind", "head", "--parts", "gammas,rounds"])
    args = ["--targets", "tiny", "--draft-kind", "head", "--parts", "gammas,load", "--sweep-gammas", "0,3",
            "--load-alpha", "0.9", "--max-tokens", "48", "--prompt-len", "8", "--vocab", str(VOCAB),
            "--concurrency", "1,3", "--load-gammas", "0,3", "--device", "cpu", "--dtype", "float32",
            "--out", str(tmp_path)]
    assert dataplane.main(args) == 0  # every token the target's greedy one
    report = json.loads((tmp_path / "dataplane.json").read_text())
    rows = report["gammas"]
    assert [r["draft"] for r in rows] == ["head", "head"] and rows[1]["tokens_per_round"] > 2.0
    served = {(r["gamma"], r["streams"]): r for r in report["load"]}
    assert all(r["draft"] == "head" and r["wrong_tokens"] == 0 and r["tokens"] == 48 * r["streams"]
               for r in served.values())
    assert served[(3, 3)]["acceptance"] > 0.6  # the worker's head drafted, and was accepted as set


def _dataplane_json(path, **records):
    path.mkdir(parents=True)
    (path / "dataplane.json").write_text(json.dumps(records))


def test_the_gpu_check_judges_each_goal_from_the_parts_files(tmp_path):
    """`bench.gpucheck`'s verdicts: each goal of issue 49 from the data-plane JSON its parts wrote, split over two
    calls' directories; a goal whose part did not run has no figure rather than a pass."""
    from specserve.bench.gpucheck import verdicts

    first, second = tmp_path / "call1", tmp_path / "call2"
    load = [{"streams": s, "gamma": g, "tok_s": t} for s, g, t in
            [(1, 0, 100.0), (1, "auto", 230.0), (16, 0, 600.0), (16, "auto", 590.0), (16, 0, 610.0),
             (16, "auto", 640.0), (64, 0, 900.0), (64, "auto", 860.0)]]
    _dataplane_json(first / "cold", load=load, startup=[{"start_s": 236.0}])
    _dataplane_json(first / "warm", load=[], startup=[{"start_s": 48.0}])
    _dataplane_json(second / "steps", args={"targets": ["7b"]},
                    steps=[{"shape": "135m", "sequences": 1, "width": 1, "step_ms": 1.3, "floor_ms": 0.07,
                            "of_floor": 1.3 / 0.07},  # the draft's shape: not the goal's step
                           {"shape": "7b", "sequences": 1, "width": 1, "step_ms": 4.5, "floor_ms": 3.39,
                            "of_floor": 4.5 / 3.39}],
                    gammas=[{"gamma": 0, "streams": 1, "tok_s": 180.0, "draft_ms_per_round": 0.0,
                             "verify_ms_per_round": 5.0},
                            {"gamma": 3, "streams": 1, "tok_s": 330.0, "draft_ms_per_round": 1.2,
                             "verify_ms_per_round": 5.5},
                            {"gamma": "auto", "streams": 1, "tok_s": 370.0, "draft_ms_per_round": 1.0,
                             "verify_ms_per_round": 5.4}])
    goals = {g["goal"]: g for g in verdicts(first, second)}
    assert goals["gamma=0 step / bandwidth floor"]["holds"] is True  # 1.33x
    assert goals["head draft step / verify step"]["value"] == round(0.4 / 5.5, 3)
    assert goals["auto / gamma=0, one stream in process"]["holds"] is True  # 370 / 180
    assert goals["load: auto / gamma=0 at 1 streams"]["holds"] is True
    assert goals["load: auto / gamma=0 at 16 streams"]["value"] == round(640 / 610, 3)  # best of each
    assert goals["load: auto / gamma=0 at 64 streams"]["holds"] is False  # 0.956 < 0.97
    assert goals["cold start, s"]["value"] == 236.0 and goals["warm start, s"]["holds"] is True
    alone = {g["goal"]: g["holds"] for g in verdicts(first)}  # the steps part's call not there: no figure
    assert alone["gamma=0 step / bandwidth floor"] is None and alone["auto / gamma=0, one stream in process"] is None


def test_the_gpu_check_keeps_each_part_in_its_limit_and_skips_what_the_budget_cannot_hold(tmp_path):
    from specserve.bench.gpucheck import run_parts

    parts = [("quick", 1, 30, ["json.tool", "--help"]),
             ("slow", 1, 1, ["timeit", "-n", "1", "import time; time.sleep(30)"]),
             ("late", 60, 60, ["json.tool", "--help"])]
    said = []
    results = {r["part"]: r for r in run_parts(parts, tmp_path, 20.0, {"PATH": "/usr/bin:/bin"}, log=said.append)}
    assert results["quick"]["returncode"] == 0 and (tmp_path / "quick.log").exists()
    assert results["slow"]["returncode"] is None and results["slow"]["seconds"] < 10  # stopped at its own limit
    assert results["late"]["skipped"] and any("late: skipped" in line for line in said)
