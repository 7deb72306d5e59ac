"""The Serve config files in cluster/ validate against Ray's schema and specserve's AppConfig."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from specserve.cli import build_parser, given_flags
from specserve.serve.run import apply_flags, check_exposure, config_from_flags, load_serve_config

CLUSTER = pathlib.Path(__file__).resolve().parents[2] / "cluster"


@pytest.mark.parametrize("name", ["local-cpu.yaml", "gpu-node.yaml", "heterogeneous.yaml", "tensor-parallel.yaml",
                                  "two-node.yaml"])
def test_cluster_config_is_valid(name):
    config = load_serve_config(CLUSTER / name)
    app = config["applications"][0]
    assert app["import_path"] == "specserve.serve:build_app"
    assert "specserve.serve.grpc_api.add_GeneratorServicer_to_server" in \
        config["grpc_options"]["grpc_servicer_functions"]


def test_broken_config_names_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CLUSTER / "local-cpu.yaml").read_text().replace("gamma: auto", "gamma: sometimes"))
    with pytest.raises(ValueError, match="gamma"):
        load_serve_config(bad)
    bad.write_text((CLUSTER / "local-cpu.yaml").read_text().replace(
        "gamma: auto", "gamma: auto\n      target_resources:\n        num_cpus: -1"))
    with pytest.raises(ValueError, match="num_cpus"):
        load_serve_config(bad)
    with pytest.raises(FileNotFoundError):
        load_serve_config(tmp_path / "missing.yaml")


def test_flags_make_the_same_shape_of_config():
    args = build_parser().parse_args(["serve", "--gamma", "3", "--http-port", "8100", "--no-pipeline", "--no-lookup"])
    config = config_from_flags(args)
    assert config["http_options"]["port"] == 8100 and config["grpc_options"]["port"] == 9000
    assert config["applications"][0]["args"]["gamma"] == 3
    assert config["applications"][0]["args"]["pipelined"] is False
    assert config["applications"][0]["args"]["draft_lookup"] is False
    assert "draft_lookup" not in config_from_flags(build_parser().parse_args(["serve"]))["applications"][0]["args"]


def test_stream_pacing_flags_reach_the_config_and_are_checked():
    from pydantic import ValidationError

    from specserve.serve import AppConfig

    flags = ["serve", "--stream-interval-ms", "60", "--stream-chunks-per-s", "0"]
    args = config_from_flags(build_parser().parse_args(flags))["applications"][0]["args"]
    config = AppConfig(**{k: v for k, v in args.items() if k in AppConfig.model_fields})
    assert config.stream_interval_ms == 60 and config.stream_chunks_per_s == 0
    assert AppConfig().stream_chunks_per_s is None  # the coordinator's 50 a core
    defaults = config_from_flags(build_parser().parse_args(["serve"]))["applications"][0]["args"]
    assert "stream_chunks_per_s" not in defaults
    with pytest.raises(ValidationError, match="stream_chunks_per_s"):
        AppConfig(stream_chunks_per_s=-1)


def test_the_compute_lanes_flag_reaches_the_target_workers_scheduling_and_is_checked():
    from pydantic import ValidationError

    from specserve.serve import AppConfig

    args = config_from_flags(build_parser().parse_args(["serve", "--compute-lanes", "1"]))["applications"][0]["args"]
    config = AppConfig(**{k: v for k, v in args.items() if k in AppConfig.model_fields})
    assert config.scheduling()["compute_lanes"] == 1
    assert AppConfig().scheduling()["compute_lanes"] is None  # the scheduler's default: 2 with 2+ threads
    with pytest.raises(ValidationError, match="compute_lanes"):
        AppConfig(compute_lanes=0)


def test_pipelining_is_on_by_default_only_when_both_workers_have_gpus():
    from specserve.serve import AppConfig

    assert AppConfig().pipelining() is False  # CPU: the overlapping forwards would share the cores
    gpus = {"draft_resources": {"num_gpus": 1}, "target_resources": {"num_gpus": 2}}
    assert AppConfig(**gpus).pipelining() is True
    assert AppConfig(**gpus, pipelined=False).pipelining() is False
    assert AppConfig(pipelined=True).pipelining() is True


def test_the_default_draft_is_the_distilled_one_where_it_is_colocated_or_has_a_gpu():
    from specserve.workers.config import WorkersConfig

    colocated = WorkersConfig()  # CPU: the draft runs inside the target worker, no second process
    assert colocated.draft == "embedded-draft" and colocated.colocated() and not colocated.has_draft_worker()
    # a split draft worker on the same CPU would compete with the target for the cores
    assert WorkersConfig(draft_placement="split").draft == "ngram"
    split = WorkersConfig(draft_resources={"num_gpus": 1})
    assert split.draft == "embedded-draft" and not split.colocated() and split.has_draft_worker()
    assert not WorkersConfig(draft="ngram").colocated() and not WorkersConfig(draft="none").has_draft_worker()
    assert WorkersConfig(target="/models/t", draft_resources={"num_gpus": 1}).draft == "ngram"
    assert WorkersConfig(draft="embedded-draft").draft == "embedded-draft"  # explicit choices stand


@pytest.mark.parametrize("name, colocated, draft_worker", [
    ("local-cpu.yaml", True, False),  # the shipped draft in the target worker, as `specserve serve` runs it
    ("gpu-node.yaml", True, False),  # draft and target share the GPU: one process
    ("heterogeneous.yaml", False, True),  # the draft on a GPU of its own
    ("tensor-parallel.yaml", False, True),
])
def test_draft_placement_of_each_cluster_config(name, colocated, draft_worker):
    from specserve.serve.app import AppConfig

    config = AppConfig(**load_serve_config(CLUSTER / name)["applications"][0]["args"])
    assert config.colocated() == colocated and config.has_draft_worker() == draft_worker


def test_tensor_parallel_from_the_flag_and_what_is_refused():
    from pydantic import ValidationError

    from specserve.workers.config import RoleResources, WorkersConfig

    args = config_from_flags(build_parser().parse_args(["serve", "--tensor-parallel", "2"]))["applications"][0]["args"]
    assert WorkersConfig(**{k: v for k, v in args.items() if k in WorkersConfig.model_fields}
                         ).target_resources.tensor_parallel == 2
    ranks = RoleResources(tensor_parallel=2, num_cpus=1, num_gpus=1, accelerator_type="H100")
    assert ranks.bundle() == {"CPU": 1, "GPU": 1, "accelerator_type:H100": 0.001}
    for bad, field in [(dict(target_resources={"tensor_parallel": 0}), "tensor_parallel"),
                       (dict(draft_resources={"tensor_parallel": 2}), "only the target"),
                       (dict(target_resources={"tensor_parallel": 2}, batching=False), "needs batching"),
                       (dict(target_resources={"tensor_parallel": 2}, target_stages=[{}, {}]), "on the stages"),
                       (dict(target_stages=[{}, {}], batching=False), "target_stages: needs batching")]:
        with pytest.raises(ValidationError, match=field):
            WorkersConfig(**bad)
    stages = WorkersConfig(target_stages=[{"tensor_parallel": 2}, {"tensor_parallel": 4}]).target_stages
    assert [s.tensor_parallel for s in stages] == [2, 4]  # a group inside each stage


def _with_flags(path, *flags):
    argv = ["serve", "--config", str(path), *flags]
    config = load_serve_config(path)
    notes = apply_flags(config, build_parser().parse_args(argv), given_flags(argv))
    return config, notes


def test_local_cpu_config_is_what_serve_runs_without_flags():
    from specserve.serve import AppConfig

    config = load_serve_config(CLUSTER / "local-cpu.yaml")
    flags = config_from_flags(build_parser().parse_args(["serve"]))
    assert config["http_options"] == flags["http_options"]
    assert config["grpc_options"]["port"] == flags["grpc_options"]["port"]
    assert AppConfig(**config["applications"][0]["args"]) == AppConfig(**flags["applications"][0]["args"])


def test_flags_beside_a_config_replace_its_values_and_say_so():
    config, notes = _with_flags(CLUSTER / "local-cpu.yaml", "--http-port", "8123", "--api-key", "K", "--target",
                                "model.gguf", "--tensor-parallel", "2", "--no-lookup", "--quantization", "auto")
    app = config["applications"][0]["args"]
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8123} and config["grpc_options"]["port"] == 9000
    assert app["target"] == "model.gguf" and app["api_key"] == "K" and app["draft_lookup"] is False
    config, _ = _with_flags(CLUSTER / "local-cpu.yaml", "--host", "10.0.0.5", "--grpc-port", "9123", "--draft",
                            "ngram")
    assert config["http_options"]["host"] == "10.0.0.5" and config["grpc_options"]["port"] == 9123
    assert config["applications"][0]["args"]["draft"] == "ngram"
    assert app["target_resources"] == {"tensor_parallel": 2} and "quantization" not in app
    assert app["draft"] == "default" and app["gamma"] == "auto"  # flags not given leave the file's values
    assert "--http-port 8123 replaces the config's http_options.port (8000)" in notes
    assert "--target model.gguf replaces application 'specserve''s target (embedded)" in notes
    assert not any("K" in note.split() for note in notes)  # a key is not printed
    # a flag given at its default value still replaces the file's (the file says 8001, the flag 8000)
    config, _ = _with_flags(CLUSTER / "gpu-node.yaml", "--http-port", "8000", "--host", "127.0.0.1")
    assert config["http_options"]["host"] == "127.0.0.1"


def test_a_model_flag_for_several_applications_is_refused_by_name(tmp_path):
    config = load_serve_config(CLUSTER / "local-cpu.yaml")
    second = dict(config["applications"][0], name="other", route_prefix="/other")
    config["applications"].append(second)
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match="--draft.*2 specserve applications"):
        _with_flags(path, "--draft", "ngram")
    config, _ = _with_flags(path, "--api-key", "K")  # a key is every application's
    assert [app["args"]["api_key"] for app in config["applications"]] == ["K", "K"]


def test_listening_beyond_loopback_asks_for_a_key(monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    open_config = load_serve_config(CLUSTER / "gpu-node.yaml")
    with pytest.raises(ValueError, match="0.0.0.0.*--api-key.*--insecure"):
        check_exposure(open_config)
    for flags in (["--api-key", "K"], ["--insecure"], ["--host", "127.0.0.1"]):
        check_exposure(_with_flags(CLUSTER / "gpu-node.yaml", *flags)[0])
    monkeypatch.setenv("SPECSERVE_API_KEY", "K")
    check_exposure(open_config)
    check_exposure(config_from_flags(build_parser().parse_args(["serve"])))  # the default: loopback
    with pytest.raises(ValueError, match="192.168.1.5"):
        monkeypatch.delenv("SPECSERVE_API_KEY")
        check_exposure(config_from_flags(build_parser().parse_args(["serve", "--host", "192.168.1.5"])))


def _app_args(*flags):
    return config_from_flags(build_parser().parse_args(["serve", *flags]))["applications"][0]["args"]


def test_gpus_by_default_where_ray_has_them():
    from specserve.serve import run
    from specserve.workers import WorkersConfig

    def defaults(*flags, gpus: float):
        config = config_from_flags(build_parser().parse_args(["serve", *flags]))
        run.default_gpus(config, gpus)
        args = config["applications"][0]["args"]
        return WorkersConfig(**{k: v for k, v in args.items() if k in WorkersConfig.model_fields}), args

    config, _ = defaults(gpus=0)
    assert config.target_resources.num_gpus == 0  # a Ray without GPUs: the CPU
    config, args = defaults("--target", "t", "--draft", "d", gpus=2)
    assert config.target_resources.num_gpus == 1 and config.target_resources.bundle()["GPU"] == 1
    assert config.colocated()  # the draft beside the target, on its GPU
    assert run.placement(args) == ["target t: 1 GPU, reserved by Ray", "draft d: in the target worker, on its device"]
    config, _ = defaults("--tensor-parallel", "2", gpus=2)  # a GPU a rank: Ray reserves one for each
    assert (config.target_resources.num_gpus, config.target_resources.tensor_parallel) == (1, 2)
    assert defaults("--tensor-parallel", "4", gpus=2)[0].target_resources.num_gpus == 0  # too few: the CPU
    config = config_from_flags(build_parser().parse_args(["serve", "--gpus", "2"]))
    assert config["applications"][0]["args"]["target_resources"] == {"num_gpus": 2}  # asked for: as asked
    # a draft with a GPU (share) of its own runs in a worker of its own
    config, args = defaults("--target", "t", "--draft", "d", "--draft-gpus", "0.5", gpus=0)
    assert config.draft_resources.num_gpus == 0.5 and not config.colocated() and config.has_draft_worker()
    assert run.placement(args)[1] == "draft d: a worker of its own on 0.5 GPU, reserved by Ray"
    # beside a config file, one field of its resources
    config, notes = _with_flags(CLUSTER / "heterogeneous.yaml", "--gpus", "1", "--draft-gpus", "1")
    app = config["applications"][0]["args"]
    assert app["target_resources"]["num_gpus"] == 1 and app["target_resources"]["accelerator_type"] == "H100"
    assert app["draft_resources"]["num_gpus"] == 1
    assert any(note.startswith("--gpus 1.0 replaces application 'specserve''s target_resources.num_gpus") for note in notes)
