"""`specserve serve`: start Ray (local unless --address), the Serve proxies and the specserve application.

Either from flags (the embedded default needs none) or from a Serve config
file such as `cluster/local-cpu.yaml` (validated with Ray's own schema).
Blocks until Ctrl-C / SIGTERM, then shuts down what it started.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import yaml
from pydantic import ValidationError

from specserve.serve import ingress
from specserve.serve.config import API_KEY_ENV, AppConfig
from specserve.serve.grpc_api import GENERATED_FUNCTION, GRPC_SERVICER_FUNCTION
from specserve.serve.listen import loopback, ray_init_options, stop_processes
from specserve.workers.quiet import descendants, quiet_env, yield_control_plane

DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 9000


def load_serve_config(path: str | pathlib.Path) -> dict[str, Any]:
    """A Serve config file, validated with Ray's ServeDeploySchema and each specserve app's args with AppConfig."""
    from ray.serve.schema import ServeDeploySchema

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") else \
        ServeDeploySchema.parse_obj(raw)
    for app in schema.applications:
        if app.import_path.startswith("specserve.serve"):
            try:
                AppConfig(**(app.args or {}))
            except ValidationError as exc:
                raise ValueError(f"{path}: application {app.name!r} args: {exc}") from None
    return raw


def model_args(args, gamma: int | str) -> dict[str, Any]:
    """The application args the model flags (`--target --draft --dtype --quantization ...`) set."""
    app_args: dict[str, Any] = {"target": args.target, "draft": args.draft, "gamma": gamma,
                                "gamma_max": args.gamma_max}
    if args.dtype:
        app_args["dtype"] = args.dtype
    for key in ("quantization", "draft_quantization"):
        if getattr(args, key, "auto") != "auto":
            app_args[key] = getattr(args, key)
    return app_args


# `specserve serve` flags that set an application's args (dest -> the arg), each given flag overriding a config file's
APP_FLAGS = {"target": "target", "draft": "draft", "dtype": "dtype", "gamma": "gamma", "gamma_max": "gamma_max",
             "quantization": "quantization", "draft_quantization": "draft_quantization", "no_pipeline": "pipelined",
             "no_lookup": "draft_lookup", "no_prefix_caching": "prefix_caching", "max_sessions": "max_sessions",
             "stream_interval_ms": "stream_interval_ms", "stream_chunks_per_s": "stream_chunks_per_s",
             "compute_lanes": "compute_lanes", "model_name": "model_name", "replicas": "num_replicas",
             "api_key": "api_key",
             "insecure": "insecure"}
# flags that set one field of a role's resources (dest -> (role, field))
RESOURCE_FLAGS = {"tensor_parallel": ("target_resources", "tensor_parallel"), "gpus": ("target_resources", "num_gpus"),
                  "draft_gpus": ("draft_resources", "num_gpus")}
# flags that set where the server listens (dest -> (section, field))
LISTEN_FLAGS = {"host": ("http_options", "host"), "http_port": ("http_options", "port"),
                "grpc_port": ("grpc_options", "port")}
# an application's args every specserve application of a config takes from a flag (the rest name one model)
SHARED_ARGS = {"api_key", "insecure"}


def specserve_apps(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The config's specserve applications, each with an `args` dict (made where it has none)."""
    apps = [app for app in config.get("applications") or [] if app.get("import_path", "").startswith("specserve.serve")]
    for app in apps:
        app["args"] = app.get("args") or {}
    return apps


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def apply_flags(config: dict[str, Any], args, given: set[str]) -> list[str]:
    """Flags given on the command line over a config file's values (in place). Returns a line for each value a flag
    replaced; a model flag for a config of several specserve applications is refused (ValueError), as it names one."""
    notes = []
    for dest, (section, key) in LISTEN_FLAGS.items():
        if dest in given:
            options = config.setdefault(section, {}) or {}
            config[section] = options
            if key in options and options[key] != getattr(args, dest):
                notes.append(f"{_flag(dest)} {getattr(args, dest)} replaces the config's {section}.{key} "
                             f"({options[key]})")
            options[key] = getattr(args, dest)
    flagged = config_from_flags(args)["applications"][0]["args"]
    apps = specserve_apps(config)
    model_flags = sorted(_flag(d) for d in given if d in RESOURCE_FLAGS or d in APP_FLAGS and APP_FLAGS[d] not in
                         SHARED_ARGS)
    if model_flags and len(apps) != 1:
        raise ValueError(f"{', '.join(model_flags)} set one application's args, and the config has {len(apps)} "
                         "specserve applications: set them in the file")
    for app in apps:
        app_args, name = app["args"], app.get("name", "default")
        for dest in sorted(given & RESOURCE_FLAGS.keys()):  # one field of the file's resources
            role, key = RESOURCE_FLAGS[dest]
            resources = dict(app_args.get(role) or {})
            before, resources[key] = resources.get(key), getattr(args, dest)
            app_args[role] = resources
            if before is not None and before != resources[key]:
                notes.append(f"{_flag(dest)} {resources[key]} replaces application {name!r}'s {role}.{key} ({before})")
        for dest in sorted(given & APP_FLAGS.keys()):
            key = APP_FLAGS[dest]
            before = app_args.get(key)
            if key in flagged:
                app_args[key] = flagged[key]
            else:  # a flag at its default value (e.g. --quantization auto): the application's default
                app_args.pop(key, None)
            if before is not None and before != app_args.get(key):
                shown = "(set)" if key == "api_key" else app_args.get(key)
                notes.append(f"{_flag(dest)} {shown} replaces application {name!r}'s {key} "
                             f"({'(set)' if key == 'api_key' else before})")
    return notes


def default_gpus(config: dict[str, Any], available: float) -> None:
    """On a Ray with GPUs (`available`), a GPU for each rank of every specserve application's target that asks for
    none (in place); a draft stays beside it. Where fewer GPUs than ranks are there, the CPU."""
    for app in specserve_apps(config):
        app_args = app["args"]
        resources = dict(app_args.get("target_resources") or {})
        if resources.get("num_gpus") or app_args.get("target_stages"):
            continue
        if available >= int(resources.get("tensor_parallel", 1)):
            resources["num_gpus"] = 1
            app_args["target_resources"] = resources


def placement(app_args: dict[str, Any]) -> list[str]:
    """Where each model of a specserve application runs, in a line a role."""
    config = AppConfig(**app_args)

    def device(res) -> str:
        if res.num_gpus > 0:
            each = f"{res.num_gpus:g} GPU" + ("" if res.num_gpus <= 1 else "s")
            kind = f" ({res.accelerator_type})" if res.accelerator_type else ""
            return (f"{each}{kind} a rank x {res.tensor_parallel} ranks" if res.tensor_parallel > 1
                    else f"{each}{kind}") + ", reserved by Ray"
        ranks = f" x {res.tensor_parallel} ranks" if res.tensor_parallel > 1 else ""
        return f"the CPU ({res.threads()} threads{ranks})"

    if config.target_stages:
        target = f"{len(config.target_stages)} pipeline stages: " + "; ".join(device(s) for s in config.target_stages)
    else:
        target = device(config.target_resources)
    lines = [f"target {config.target}: {target}"]
    if config.draft == "none":
        lines.append("draft: none (plain decoding)")
    elif config.draft == "ngram" or (config.draft == "default" and config.target != "embedded"):
        lines.append("draft: prompt lookup (n-gram) " + ("in a worker of its own" if config.ngram_worker
                                                        else "in the coordinator"))
    elif config.colocated():
        lines.append(f"draft {config.draft}: in the target worker, on its device")
    else:
        lines.append(f"draft {config.draft}: a worker of its own on {device(config.draft_resources)}")
    return lines


def check_exposure(config: dict[str, Any]) -> None:
    """A server that listens beyond loopback asks every specserve application for an API key, unless one says
    `insecure: true` (--insecure): else ValueError saying how to go on."""
    host = str((config.get("http_options") or {}).get("host", "127.0.0.1"))
    if loopback(host):
        return
    for app in specserve_apps(config):
        app_config = AppConfig(**app["args"])
        if app_config.api_key is None and not app_config.insecure:
            raise ValueError(
                f"the server would listen on {host} (beyond this machine) with no API key, open to anyone who can "
                f"reach it: give one (--api-key, ${API_KEY_ENV} or the application's api_key), listen on 127.0.0.1 "
                "(--host), or serve openly on purpose (--insecure, or insecure: true in the application's args)")


def config_from_flags(args) -> dict[str, Any]:
    app_args = model_args(args, args.gamma)
    if args.no_pipeline:
        app_args["pipelined"] = False
    if args.no_lookup:
        app_args["draft_lookup"] = False
    if args.model_name:
        app_args["model_name"] = args.model_name
    if getattr(args, "no_prefix_caching", False):
        app_args["prefix_caching"] = False
    if getattr(args, "max_sessions", None):
        app_args["max_sessions"] = args.max_sessions
    if getattr(args, "stream_interval_ms", None) is not None:
        app_args["stream_interval_ms"] = args.stream_interval_ms
    if getattr(args, "stream_chunks_per_s", None) is not None:
        app_args["stream_chunks_per_s"] = args.stream_chunks_per_s
    if getattr(args, "replicas", 1) != 1:
        app_args["num_replicas"] = args.replicas
    if getattr(args, "compute_lanes", None) is not None:
        app_args["compute_lanes"] = args.compute_lanes
    target: dict[str, Any] = {}
    if getattr(args, "tensor_parallel", 1) != 1:
        target["tensor_parallel"] = args.tensor_parallel
    if getattr(args, "gpus", None):  # unset: `default_gpus` once Ray says what it has
        target["num_gpus"] = args.gpus
    if target:
        app_args["target_resources"] = target
    if getattr(args, "draft_gpus", None):
        app_args["draft_resources"] = {"num_gpus": args.draft_gpus}
    if getattr(args, "api_key", None):
        app_args["api_key"] = args.api_key
    if getattr(args, "insecure", False):
        app_args["insecure"] = True
    return {
        "http_options": {"host": args.host, "port": args.http_port},
        "grpc_options": {"port": args.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER_FUNCTION]},
        "applications": [{"name": "specserve", "route_prefix": "/", "import_path": "specserve.serve:build_app",
                          "args": app_args}],
    }


def prestart(config: dict[str, Any]):
    """On a local Ray: the target worker of a config's one specserve application started now, before Serve's
    controller and proxy, so that its process starts and its models load meanwhile; the application's replica adopts
    it (`prestarted_target`, set in place). Returns the worker's handle (keep it: the actor ends with its last
    reference), or None where that does not apply (several applications or replicas, a
    draft worker of its own, tensor-parallel ranks or stages: the replica starts its workers)."""
    import uuid

    from specserve.workers.launch import can_prestart, prestart_target

    apps = specserve_apps(config)
    if len(apps) != 1:
        return None
    app_config = AppConfig(**apps[0]["args"])
    if app_config.num_replicas != 1 or app_config.autoscaling_config is not None or not can_prestart(app_config):
        return None
    name = f"specserve-target-{uuid.uuid4().hex[:12]}"
    actor = prestart_target(app_config, app_config.gamma_max, name)
    apps[0]["args"]["prestarted_target"] = name
    return actor


def start(config: dict[str, Any]) -> list[str]:
    """serve.start + deploy every application of a Serve config dict (Ray must be initialised). Returns app names."""
    from ray import serve
    from ray._common.utils import import_attr
    from ray.serve.config import HTTPOptions, gRPCOptions

    http = dict(config.get("http_options") or {})
    grpc_opts = dict(config.get("grpc_options") or {})
    grpc_opts.setdefault("port", DEFAULT_GRPC_PORT)
    # the generated registration (older configs name it) is replaced by ours: it answers undecodable messages
    functions = [f for f in grpc_opts.get("grpc_servicer_functions") or [] if f != GENERATED_FUNCTION]
    if GRPC_SERVICER_FUNCTION not in functions:
        functions.append(GRPC_SERVICER_FUNCTION)
    grpc_opts["grpc_servicer_functions"] = functions
    serve.start(http_options=HTTPOptions(**http), grpc_options=gRPCOptions(**grpc_opts))
    names = []
    for app in config.get("applications", []):
        target = import_attr(app["import_path"])
        application = target(app.get("args") or {}) if callable(target) and not hasattr(target, "_bound_deployment") \
            else target
        name = app.get("name", "default")
        print(f"[specserve] deploying {name!r} ({app['import_path']}); loading models and calibrating ...",
              flush=True)
        serve.run(application, name=name, route_prefix=app.get("route_prefix", "/"))
        names.append(name)
    return names


def ports(config: dict[str, Any]) -> tuple[str, int, int]:
    """The host, HTTP port and gRPC port a config serves on."""
    http = config.get("http_options") or {}
    return (http.get("host", "127.0.0.1"), int(http.get("port", DEFAULT_HTTP_PORT)),
            int((config.get("grpc_options") or {}).get("port", DEFAULT_GRPC_PORT)))


def usage_text(config: dict[str, Any], metrics_port: int = 0) -> str:
    host, port, grpc_port = ports(config)
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{host}:{port}"
    metrics = (f"  Prometheus metrics (ray_specserve_*): curl -s http://127.0.0.1:{metrics_port}/metrics"
               " | grep specserve\n" if metrics_port else "")
    apps = config.get("applications") or [{}]
    keyed = any(AppConfig(**(app.get("args") or {})).api_key for app in apps
                if app.get("import_path", "specserve").startswith("specserve"))
    auth = " -H \"Authorization: Bearer $SPECSERVE_API_KEY\"" if keyed else ""
    key = "os.environ['SPECSERVE_API_KEY']" if keyed else "'-'"
    return f"""
[specserve] serving. Try:
  the playground (tokens coloured by how speculation made them): open {base}/ in a browser
  curl {base}/health
  curl {base}/v1/completions -H 'Content-Type: application/json'{auth} \\
       -d '{{"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0}}'
  python -c "import os, openai; c = openai.OpenAI(base_url='{base}/v1', api_key={key}); \\
print(c.chat.completions.create(model=c.models.list().data[0].id, \\
messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)"
  gRPC: specserve.v1.Generator/Generate and /GenerateStream on {host}:{grpc_port} (protos/specserve/v1/generator.proto)
{metrics}Ctrl-C stops the server.
"""


def model_specs(config: dict) -> list[str]:
    """The model specs the configured applications load: each target, then a model draft."""
    out = []
    for app in config.get("applications") or []:
        args = app.get("args") or {}
        out.append(str(args.get("target", "embedded")))
        draft = str(args.get("draft", "default"))
        if draft not in ("default", "ngram", "none"):
            out.append(draft)
    return out


def _read_models(config: dict, local: bool, kernels_line: Future) -> None:
    """On a thread of `serve_main`'s while Ray starts: the models' files read (`read_metadata`), the CPU kernels
    built where the workers run here (`local`), then `kernels_line` set (which CPU path the steps take; an error
    reading a file instead). Which forward each model takes the workers say once they load it
    (`workers.actors.say_path`)."""
    try:
        from specserve.models.formats.ggufmodel import read_metadata
        from specserve.models.kernels import cpu

        # a first start compiles the CPU kernels (g++, once) while it reads its GGUF files' digests and metadata
        kernels = threading.Thread(target=cpu.library, name="specserve-kernels", daemon=True)
        if local:
            kernels.start()
        read_metadata(model_specs(config))
        if local:
            kernels.join()
        kernels_line.set_result(f"bfloat16 CPU steps: {cpu.describe()}" if local else None)
    except BaseException as exc:  # noqa: BLE001 - handed to serve_main, which reports it
        kernels_line.set_exception(exc)


def serve_main(args, given: set[str] | None = None) -> int:
    """given: the flags the command line named (with --config, those override the file's values)."""
    import ray

    try:
        if args.config:
            config = load_serve_config(args.config)
            for note in apply_flags(config, args, given or set()):
                print(f"[specserve] {note}", flush=True)
            for app in specserve_apps(config):
                AppConfig(**app["args"])
        else:
            config = config_from_flags(args)
            AppConfig(**config["applications"][0]["args"])
        check_exposure(config)
    except (ValueError, FileNotFoundError, ValidationError, yaml.YAMLError) as exc:
        print(f"specserve: {exc}", file=sys.stderr)
        return 2
    # the models' files read (a first start: their digests and metadata, the CPU kernels' compile) while Ray starts
    kernels_line = Future()
    threading.Thread(target=_read_models, args=(config, not args.address, kernels_line),
                     name="specserve-models", daemon=True).start()
    host, http_port, grpc_port = ports(config)
    if not args.address:
        for name, port in (("HTTP", http_port), ("gRPC", grpc_port)):
            if ingress.port_in_use(host, port) and not ingress.listening(host, port):
                print(f"[specserve] the {name} port {host}:{port} is held by connections a server just closed "
                      "(TCP TIME_WAIT, up to a minute): waiting for it", flush=True)
            if not ingress.wait_for_port(host, port):
                print(f"specserve: the {name} port {host}:{port} is in use (another server?): choose another "
                      f"(--{name.lower()}-port, or the config's {name.lower()}_options.port)", file=sys.stderr)
                return 2
    why_proxy = ingress.plan(config, getattr(args, "ingress", "direct"), args.address)
    if why_proxy is None:
        print(f"[specserve] ingress: the application's replica answers {host}:{http_port} (HTTP) and :{grpc_port} "
              "(gRPC) itself (Serve's direct ingress)", flush=True)
        deployed = ingress.use_direct(config, host, http_port, grpc_port)
    else:
        print(f"[specserve] ingress: Serve's proxy ({why_proxy})", flush=True)
        deployed = config
    metrics_port = args.metrics_port if not args.address else 0
    options: dict[str, Any] = {"_metrics_export_port": metrics_port} if metrics_port else {}
    if not args.address:  # a local Ray: keep its listeners, and Serve's gRPC proxy, on the configured host
        options.update(ray_init_options((config.get("http_options") or {}).get("host", "127.0.0.1")))
        quiet_env()  # and its periodic work out of the forwards' way (`workers.quiet`)
    ray.init(address=args.address or "local", include_dashboard=False, **options)
    try:
        if (line := kernels_line.result()) is not None:
            print(f"[specserve] {line}", flush=True)
    except (ValueError, FileNotFoundError) as exc:
        print(f"specserve: {exc}", file=sys.stderr)
        ray.shutdown()
        return 2
    if not args.config and "gpus" not in (given or set()):  # the defaults: a GPU for the target where Ray has one
        default_gpus(deployed, ray.cluster_resources().get("GPU", 0))
    for app in specserve_apps(deployed):
        for line in placement(app["args"]):
            print(f"[specserve] {line}", flush=True)
    # its handle kept while serving: a named actor ends with its owner's last reference
    prestarted = prestart(deployed) if not args.address else None
    from ray import serve  # (a second of imports: once the target worker is on its way)
    if prestarted is not None:
        print("[specserve] the target worker starts beside Serve's controller and proxy (its models load meanwhile)",
              flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        start(deployed)
        if not args.address:
            yield_control_plane()
        print(usage_text(config, metrics_port), flush=True)
        stop.wait()
    except Exception as exc:  # noqa: BLE001 - report the failure, then clean up
        print(f"specserve: serving failed: {exc}", file=sys.stderr)
        return 1
    finally:
        print("[specserve] shutting down", flush=True)
        started = set(descendants(os.getpid())) if not args.address else set()
        serve.shutdown()
        ray.shutdown()
        # return only once nothing listens on the ports: Ray's processes end on their own a while after it shuts down
        if stragglers := stop_processes(started):
            print(f"[specserve] stopped {len(stragglers)} process(es) of the local Ray that outlived it", flush=True)
        for name, port in (("HTTP", http_port), ("gRPC", grpc_port)):
            deadline = time.monotonic() + 10
            while not args.address and ingress.listening(host, port) and time.monotonic() < deadline:
                time.sleep(0.1)
    return 0
