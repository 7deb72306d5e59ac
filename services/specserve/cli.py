"""`specserve` command line: generate text, serve, run the benchmark."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import yaml

from specserve.bench.prompts import PER_WORKLOAD
from specserve.speculation import parse_gamma


def _gamma(value: str) -> int | str:
    try:
        return parse_gamma(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _temperatures(value: str) -> tuple[float, ...]:
    try:
        temps = tuple(float(t) for t in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {value!r}") from None
    if not temps or min(temps) < 0:
        raise argparse.ArgumentTypeError(f"temperatures must be >= 0, got {value!r}")
    return temps


def _quantization(value: str) -> str:
    from specserve.quantization import parse

    try:
        parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="embedded", help="HF id/dir, .gguf file, or 'embedded' (default)")
    p.add_argument("--draft", default="default",
                   help="HF id/dir, .gguf file, 'embedded-draft', 'ngram', 'none', 'head:PATH' (a feature head; served: in the "
                   "target worker), 'eagle3:PATH' (a public EAGLE-3 head; served: in the target worker), or 'default': the shipped "
                   "distilled draft for the embedded target, else ngram (bench: a comma-separated list runs each)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float64"],
                   help="default: bf16 where fast, else fp32; float64 (slow) for checking exactness to rounding")
    p.add_argument("--gamma-max", type=int, default=8, help="deepest speculation auto/heuristic may choose")
    p.add_argument("--quantization", type=_quantization, default="auto",
                   help="target weights: auto (a GGUF file's own quantization, else dense), none, int8, int4 "
                   "(int4-g64, int4-g128); quantized computes in bf16")
    p.add_argument("--draft-quantization", type=_quantization, default="auto", help="the same for a model draft")


def _add_lookup_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-lookup", action="store_true",
                   help="a model draft drafts alone (default: prompt lookup first where the context repeats)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    _add_model_args(gen)
    gen.add_argument("--gamma", type=_gamma, default="auto", help="int (0 = no speculation), 'auto' or 'heuristic'")
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print the result and stats as JSON")
    _add_lookup_arg(gen)

    bench = sub.add_parser("bench", help="side-by-side speed measurements (JSON + PNG)")
    _add_model_args(bench)
    bench.add_argument("--out", default="bench-out", help="directory for bench.json and bench.png")
    bench.add_argument("--max-new-tokens", type=int, default=96)
    bench.add_argument("--workloads", default="chat,rewrite,code", help="comma-separated subset")
    bench.add_argument("--prompts", type=int, default=2,
                       help=f"prompts per workload, 1-{PER_WORKLOAD} (default 2: the suite's first two)")
    bench.add_argument("--gammas", default="1,2,3,4,5,6,7,8", help="fixed γ values to run")
    bench.add_argument("--repeats", type=int, default=1, help="runs per prompt and method; the fastest counts")
    bench.add_argument("--draft-stop-below", type=float, default=0.0,
                       help="a model draft ends its block where its top probability is below this (0: off)")
    bench.add_argument("--quick", action="store_true", help="one prompt per workload, γ ∈ {2,4}, 48 tokens")
    bench.add_argument("--served", action="store_true",
                       help="measure the served path (Ray Serve + gRPC workers) against the in-process engine")
    bench.add_argument("--placements", default=None,
                       help="--served with a model draft: which of colocated,sequential,pipelined to deploy (one "
                       "application at a time; default: all three)")
    bench.add_argument("--served-gamma", type=_gamma, default=3, help="γ for --served (fixed, so both paths emit the same tokens)")
    bench.add_argument("--load", action="store_true",
                       help="concurrent streams with the openai client: aggregate tok/s, TTFT, ITL per concurrency "
                       "(load.json/.png; starts a server unless --url)")
    bench.add_argument("--url", default=None, help="--load: a running server's base URL (e.g. http://127.0.0.1:8000/v1), "
                       "or 'inprocess': the target worker in this process, nothing served (batching alone)")
    bench.add_argument("--concurrency", default="1,4,16,32", help="--load: concurrency levels")
    bench.add_argument("--load-requests", type=int, default=2, help="--load: requests per stream and level")
    bench.add_argument("--load-rounds", type=int, default=1,
                       help="--load: rounds of every level and configuration, each round in the reverse order of the "
                       "last (ABBA); reports the median run, the median paired ratio to the first configuration and "
                       "of each level to the first level (this machine's speed drifts)")
    bench.add_argument("--long-prompt", type=int, default=0,
                       help="--load: also measure short streams' TTFT while a prompt of this many tokens is prefilled")
    bench.add_argument("--load-configs", default="gamma0,auto",
                       help="--load: gamma0, auto (batched server, per-request γ), unbatched, unbatched-auto "
                       "(a second application with batching off), uncached, uncached-auto (prefix caching off)")
    bench.add_argument("--system-prompt", type=int, default=0, metavar="TOKENS",
                       help="--load: every request starts with the same system prompt of about this many tokens; "
                       "first measures TTFT of 8 requests in a row and of a 4-turn chat on each server")
    dst = sub.add_parser("distill", help="train a small draft against the target's own distributions")
    dst.add_argument("--target", default="embedded", help="HF id/dir, .gguf file, or 'embedded' (default)")
    dst.add_argument("--out", required=True, help="output model directory (also holds corpus + checkpoint)")
    dst.add_argument("--layers", type=int, default=None, help="draft layers (default 2)")
    dst.add_argument("--hidden", type=int, default=None,
                     help="default: the target's (start from its layers, share its embedding); smaller: a fresh model")
    dst.add_argument("--subset", type=int, default=None,
                     help="LM-head rows: the tokens with the most target probability mass (default 8192; 0: full "
                          "vocabulary)")
    dst.add_argument("--head", action="store_true",
                     help="train a feature head instead of a draft LM: one decoder layer on the target's own hidden "
                          "states (EAGLE's design; docs/design.md 'Feature heads'), used as --draft head:OUT; with "
                          "--init, the head starts as that draft (its layers) and learns what the features add")
    dst.add_argument("--init", default=None,
                     help="go on training this draft of the target ('embedded-draft' or a directory distill wrote) "
                          "instead of a new one: adapts it to new data (e.g. --text) in minutes; keeps its shape")
    dst.add_argument("--prompts", type=int, default=2400, help="training prompts the target answers (0: none)")
    dst.add_argument("--self-prompts", type=int, default=1200,
                     help="requests the target writes itself and then answers (0: templates only)")
    dst.add_argument("--gen-tokens", type=int, default=128, help="longest answer the target writes")
    dst.add_argument("--gen-temperatures", type=_temperatures, default=(0.0, 0.7, 1.0),
                     help="comma-separated temperatures the answers cycle through (default 0,0.7,1)")
    dst.add_argument("--gen-batch", type=int, default=48, help="answers written per target forward")
    dst.add_argument("--top-k", type=int, default=32, help="target log-probabilities kept per position")
    dst.add_argument("--text", action="append", default=[], help="extra plain-text file (repeatable)")
    dst.add_argument("--steps", type=int, default=1200)
    dst.add_argument("--batch", type=int, default=8, help="sequences per training step")
    dst.add_argument("--seq-len", type=int, default=384)
    dst.add_argument("--lr", type=float, default=1e-3)
    dst.add_argument("--warmup", type=int, default=50)
    dst.add_argument("--kd-temperature", type=float, default=1.0)
    dst.add_argument("--feature-weight", type=float, default=1.0,
                     help="--head: the weight of its predicted-feature loss (smooth L1) beside the KD loss")
    dst.add_argument("--freeze-init", action="store_true",
                     help="--head --init: keep the draft's layers, norm and head as they are and train fc alone (the "
                          "features' way in), so a small corpus cannot cost the draft's acceptance")
    dst.add_argument("--live-features", action="store_true",
                     help="--head: compute the target's features of each batch at its step instead of once for the "
                          "whole corpus (records x --seq-len x hidden, bfloat16): for targets whose corpus features "
                          "outgrow memory (a 7B's: 3 MiB a record at 384 positions)")
    dst.add_argument("--feature-dropout", type=float, default=0.0,
                     help="--head: zero this share of the features it reads in training (0 <= P < 1); then it "
                          "drafts on a zero feature where the target's is not known yet, not on its own prediction")
    dst.add_argument("--checkpoint-every", type=int, default=100)
    dst.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts (subjects never trained on)")
    dst.add_argument("--eval-tokens", type=int, default=96)
    dst.add_argument("--seed", type=int, default=0)

    kr = sub.add_parser("kuberay", help="render a KubeRay RayService manifest from a Serve config (cluster/*.yaml)")
    kr.add_argument("config", help="Serve config file, e.g. cluster/heterogeneous.yaml")
    kr.add_argument("--out", default=None, help="write here instead of stdout")
    kr.add_argument("--name", default=None, help="RayService name (default: specserve-<config file stem>)")
    kr.add_argument("--image", default=None, help="container image (default: specserve:0.1.0, see Dockerfile)")
    kr.add_argument("--models-claim", default=None,
                    help="PersistentVolumeClaim mounted read-only at /models in every pod (model directories)")
    kr.add_argument("--worker-memory", default=None, help="memory per worker pod (default 32Gi)")
    kr.add_argument("--shm", default=None, help="size of the memory-backed /dev/shm, Ray's object store (default 8Gi)")

    srv = sub.add_parser("serve", help="serve over HTTP (OpenAI-compatible) and gRPC on Ray Serve")
    srv.add_argument("--config", default=None, help="a Serve config file, e.g. cluster/local-cpu.yaml; a flag "
                     "given beside it replaces the file's value (and says so)")
    _add_model_args(srv)
    srv.add_argument("--gamma", type=_gamma, default="auto", help="default γ: int, 'auto' or 'heuristic'")
    srv.add_argument("--no-pipeline", action="store_true", help="do not overlap drafting with verification")
    _add_lookup_arg(srv)
    srv.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                     help="split the target's layers over N ranks (Ray actors on one node; on GPUs one each)")
    srv.add_argument("--gpus", type=float, default=None, metavar="N",
                     help="GPUs Ray reserves for the target (for each tensor-parallel rank); default: 1 where the Ray "
                     "cluster has GPUs (one for each rank), else 0 (the CPU)")
    srv.add_argument("--draft-gpus", type=float, default=None, metavar="N",
                     help="a model draft in a worker of its own with N GPUs (0.5: half of one, shared); default: in "
                     "the target worker, on its device")
    srv.add_argument("--replicas", type=int, default=1, metavar="N",
                     help="Serve replicas, each with workers (models) of its own, behind Serve's proxy")
    srv.add_argument("--no-prefix-caching", action="store_true",
                     help="prefill every prompt in full (default: reuse the cached keys/values of a shared prefix)")
    srv.add_argument("--max-sessions", type=int, default=None, metavar="N",
                     help="sessions run at once (default 64); more wait in a queue (max_queued, queue_timeout_s)")
    srv.add_argument("--stream-interval-ms", type=float, default=None, metavar="MS",
                     help="a stream's rounds within MS of its last chunk go as one chunk (default 40; 0: a chunk "
                     "per round)")
    srv.add_argument("--stream-chunks-per-s", type=float, default=None, metavar="N",
                     help="chunks a second all streams send before each one's interval grows (default: 50 a core; "
                     "0: never)")
    srv.add_argument("--compute-lanes", type=int, default=None, metavar="N",
                     help="with 8+ sessions open, split them among N compute threads of the target worker (default: "
                     "2 with 2+ threads; 1: one step over all)")
    srv.add_argument("--model-name", default=None, help="model id clients pass (default: the target's name)")
    srv.add_argument("--host", default="127.0.0.1",
                     help="the address HTTP and gRPC listen on (0.0.0.0: every interface, which needs --api-key or "
                     "--insecure)")
    srv.add_argument("--insecure", action="store_true",
                     help="serve without an API key on an address beyond loopback (refused otherwise)")
    srv.add_argument("--api-key", default=None,
                     help="clients must send 'Authorization: Bearer KEY' (gRPC: metadata 'authorization'); default: "
                     "$SPECSERVE_API_KEY, else none")
    srv.add_argument("--http-port", type=int, default=8000)
    srv.add_argument("--grpc-port", type=int, default=9000)
    srv.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray)")
    srv.add_argument("--ingress", choices=("direct", "proxy"), default="direct",
                     help="direct (default): a local server's application replica answers the HTTP and gRPC ports "
                     "itself; proxy: through Serve's proxy process (always with --address or several applications)")
    srv.add_argument("--metrics-port", type=int, default=8080,
                     help="Prometheus metrics port of the local Ray started here (0: none; with --address the "
                     "cluster's own --metrics-export-port applies)")
    return parser


def _generate(args) -> int:
    from pydantic import ValidationError

    from specserve import SamplingParams, SpeculativeDecoder

    try:
        params = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop
        )
    except ValidationError as exc:
        print(f"specserve: invalid sampling parameters: {exc}", file=sys.stderr)
        return 2
    if not args.prompt.strip():
        print("specserve: prompt must not be empty", file=sys.stderr)
        return 2
    draft = None if args.draft == "none" else args.draft
    try:
        decoder = SpeculativeDecoder(args.target, draft, gamma=args.gamma, dtype=args.dtype, gamma_max=args.gamma_max,
                                     draft_lookup=not args.no_lookup, quantization=args.quantization,
                                     draft_quantization=args.draft_quantization)
        prompt = args.prompt
        if not args.raw and decoder.tokenizer is not None and decoder.tokenizer.chat_template:
            prompt = [{"role": "user", "content": args.prompt}]
        result = decoder.generate(prompt, params, args.max_new_tokens)
    except (ValueError, FileNotFoundError) as exc:
        print(f"specserve: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print(result.text)
    s = result.stats
    mean_gamma = sum(s.gamma_history) / len(s.gamma_history) if s.gamma_history else 0.0
    print(
        f"[specserve] {s.new_tokens} tokens in {s.total_time_s:.2f}s ({s.tokens_per_s:.1f} tok/s) | "
        f"γ {s.controller} (mean {mean_gamma:.1f}) | acceptance {s.acceptance_rate:.2f} | "
        f"{s.mean_accepted_length:.2f} tokens/round | finish: {result.finish_reason}",
        file=sys.stderr,
    )
    return 0


def _distill(args) -> int:
    from specserve.distill import DistillConfig, distill

    shape = [name for name, value in (("--layers", args.layers), ("--hidden", args.hidden), ("--subset", args.subset))
             if value is not None]
    if args.init and shape:
        print(f"specserve distill: {', '.join(shape)} cannot be changed with --init (the draft keeps its shape)",
              file=sys.stderr)
        return 2
    if args.head and (args.hidden is not None or args.layers is not None):
        print("specserve distill: --head trains one layer at the target's hidden size, or starts from the draft "
              "--init names (its layers); --layers and --hidden do not apply", file=sys.stderr)
        return 2
    layers = DistillConfig.layers if args.layers is None else args.layers
    subset = DistillConfig.subset if args.subset is None else args.subset
    sizes = {"--layers": layers, "--gen-tokens": args.gen_tokens,
             "--gen-batch": args.gen_batch, "--top-k": args.top_k, "--steps": args.steps, "--batch": args.batch,
             "--seq-len": args.seq_len, "--eval-prompts": args.eval_prompts, "--eval-tokens": args.eval_tokens,
             "--checkpoint-every": args.checkpoint_every}
    bad = [name for name, value in sizes.items() if value < 1]
    bad += [name for name, value in (("--subset", subset), ("--warmup", args.warmup), ("--prompts", args.prompts),
                                     ("--self-prompts", args.self_prompts)) if value < 0]
    bad += [name for name, value in (("--lr", args.lr), ("--kd-temperature", args.kd_temperature)) if value <= 0]
    bad += ["--feature-weight"] if args.feature_weight < 0 else []
    bad += ["--feature-dropout"] if not 0 <= args.feature_dropout < 1 else []
    if args.freeze_init and not (args.head and args.init):
        print("specserve distill: --freeze-init keeps the layers of the draft a head starts from (--head --init)",
              file=sys.stderr)
        return 2
    bad += ["--hidden"] if args.hidden is not None and args.hidden < 1 else []
    if bad:
        print(f"specserve distill: invalid {', '.join(bad)} (sizes must be >= 1, --subset/--warmup/--prompts/"
              "--self-prompts/--feature-weight >= 0, --lr/--kd-temperature > 0, 0 <= --feature-dropout < 1)",
              file=sys.stderr)
        return 2
    cfg = DistillConfig(
        target=args.target, out=args.out, layers=layers, hidden=args.hidden, subset=subset, init=args.init,
        prompts=args.prompts, self_prompts=args.self_prompts, gen_tokens=args.gen_tokens, gen_temperatures=args.gen_temperatures,
        gen_batch=args.gen_batch, top_k=args.top_k, texts=args.text, steps=args.steps, batch=args.batch,
        seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, kd_temperature=args.kd_temperature,
        checkpoint_every=args.checkpoint_every, eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens,
        seed=args.seed, head=args.head, feature_weight=args.feature_weight,
        feature_dropout=args.feature_dropout, freeze_init=args.freeze_init,
        live_features=args.live_features,
    )
    try:
        metrics = distill(cfg)
    except (ValueError, FileNotFoundError) as exc:
        print(f"specserve: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(metrics, indent=2))
    return 0


def _kuberay(args) -> int:
    from pydantic import ValidationError

    from specserve.serve.kuberay import render_file

    try:
        text = render_file(args.config, args.name, image=args.image, models_claim=args.models_claim,
                           worker_memory=args.worker_memory, shm=args.shm)
    except (ValueError, FileNotFoundError, ValidationError, yaml.YAMLError) as exc:
        print(f"specserve kuberay: {exc}", file=sys.stderr)
        return 2
    if args.out:
        pathlib.Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def given_flags(argv: list[str] | None) -> set[str]:
    """The dests of the `serve` flags the command line names (whatever their values)."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in subparsers.choices["serve"]._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "distill":
        return _distill(args)
    if args.command == "kuberay":
        return _kuberay(args)
    if args.command == "serve":
        from specserve.serve.run import serve_main

        return serve_main(args, given_flags(argv))
    # bench, in process or --served, from here on
    if not 1 <= args.prompts <= PER_WORKLOAD:
        print(f"specserve bench: --prompts must be 1-{PER_WORKLOAD} (prompts per workload), got {args.prompts}",
              file=sys.stderr)
        return 2
    if args.load:
        from specserve.bench.load import run_load_bench

        return run_load_bench(args)
    if args.served:
        from specserve.bench.served import run_served_bench

        return run_served_bench(args)
    from specserve.bench.run import run_bench

    return run_bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
