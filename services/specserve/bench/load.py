"""`specserve bench --load`: many concurrent streams against a server, with the real `openai` async client.

At each concurrency level (1, 4, 16, 32 by default) that many streams each send `--load-requests`
streaming chat requests one after another (the bench's chat prompts, greedy, `--max-new-tokens`, eos
ignored so every answer has the same length). Per level and configuration it reports aggregate tokens/s
(all completion tokens / the level's wall time), per-stream tokens/s, time to first token and inter-token
latency (per request: (end − first token) / (tokens − 1)) at p50/p95, acceptance and mean γ from the
`specserve` statistics of each answer. Levels run configuration after configuration, so every
configuration meets the machine in the same state. A small machine's speed drifts within minutes, so
`--load-rounds N` runs each level's configurations N times, in ABBA order (every other round reversed), and
reports each configuration's median run and the median of its paired ratios to the first configuration
(runs of the same round side by side). Queue time (how long a request waited for a session slot, from the
server's statistics) is reported beside TTFT, which includes it. A request whose connection ends before any
answer (a kept-alive connection the server had closed) is sent once more on a new one and counted (`retried`);
a second such failure, a timeout or an HTTP error is the request's error. Writes load.json and load.png.

`--system-prompt N` puts the same ~N-token system prompt in front of every request (as chat products do), and
first runs the prefix-caching check on each server: 8 requests in a row with different questions, then a
4-turn chat, TTFT of each and whether the answers equal those of a server with prefix caching off.

Without `--url` it starts Ray and one Serve application per server configuration itself: `batched`
(serves both `γ=0` and `auto` through the per-request `gamma`) and, with `--load-configs` naming it,
`unbatched` (the target worker running one session at a time, as before batching) and `uncached`
(prefix caching off). With `batched` alone its replica answers HTTP itself, as `specserve serve`'s does
(`serve.ingress`); several applications share Serve's proxy.

`--url inprocess` measures the same load with nothing served: the target worker `specserve serve` would start
(`TargetWorkerActor`, its model draft beside it) built in this process, each stream a thread calling its
`Generate` with the prompt the server would encode. The figures are then those of the worker's batching alone,
without HTTP, the ingress, gRPC's wire and Ray: what a served figure is to be compared with on the same machine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pathlib
import statistics
import sys
import time

from specserve.bench.prompts import SUITE

CONFIGS = {  # name -> (application, per-request gamma or None for the server's default)
    "gamma0": ("batched", 0),
    "auto": ("batched", "auto"),
    "unbatched": ("unbatched", 0),
    "unbatched-auto": ("unbatched", "auto"),
    "uncached": ("uncached", 0),
    "uncached-auto": ("uncached", "auto"),
}

_SYSTEM_TEXT = ("You are the support assistant of a company that rents bicycles in a seaside town. Answer briefly "
                "and politely, quote prices in euros, and never promise a bicycle that is not in stock. ")


def system_prompt(tokens: int) -> str:
    """About `tokens` tokens of instructions (numbered, so no two sentences repeat exactly)."""
    rules, k = [], 0
    while len(" ".join(rules)) < 4.4 * tokens:  # ~4.4 characters a token for this English text (SmolLM2)
        k += 1
        rules.append(f"Rule {k}: {_SYSTEM_TEXT}")
    return " ".join(rules)


def _messages(prompt: str, system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]



def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _stream(client, model: str, prompt: str | list[dict], max_tokens: int, gamma,
                  system: str | None = None) -> dict:
    """One streamed chat request (prompt: the user's text, or the whole message list)."""
    import openai

    body = {"ignore_eos": True}
    if gamma is not None:
        body["gamma"] = gamma
    t0 = time.perf_counter()
    first = None
    stats: dict = {}
    tokens = prompt_tokens = 0
    text = []
    messages = prompt if isinstance(prompt, list) else _messages(prompt, system)
    retried = 0
    while True:
        try:
            response = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body=body,
            )
            break
        except openai.APIConnectionError as exc:
            # A kept-alive connection the server closed as it was reused fails before the request is sent;
            # one new connection is tried (a timeout, or a second failure, is the request's error).
            if retried or isinstance(exc, openai.APITimeoutError):
                raise
            retried = 1
    async for chunk in response:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        extra = chunk.model_extra or {}
        if chunk.usage is not None:  # the last chunk (include_usage)
            tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        stats = extra.get("specserve") or stats
    end = time.perf_counter()
    first = first or end
    return {"start": t0, "end": end, "ttft": first - t0, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "itl": (end - first) / (tokens - 1) if tokens > 1 else 0.0, "stats": stats, "text": "".join(text),
            "retried": retried}


async def _level(base_url: str, concurrency: int, requests: int, max_tokens: int, gamma, prompts: list[str],
                 system: str | None = None) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="-", timeout=1800, max_retries=0)
    model = (await client.models.list()).data[0].id
    results: list[dict] = []
    errors: list[str] = []

    async def stream(k: int) -> None:
        for r in range(requests):
            try:
                results.append(await _stream(client, model, prompts[(k + r) % len(prompts)], max_tokens, gamma,
                                             system))
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(exc).__name__}: {exc}"[:200])

    t0 = time.perf_counter()
    await asyncio.gather(*(stream(k) for k in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return _row(concurrency, results, errors, wall)


def _row(concurrency: int, results: list[dict], errors: list[str], wall: float) -> dict:
    """A level's figures from its requests (`_stream`'s dicts)."""
    tokens = sum(r["tokens"] for r in results)
    drafted = sum(r["stats"].get("drafted", 0) for r in results)
    accepted = sum(r["stats"].get("accepted", 0) for r in results)
    gammas = [g for r in results for g in r["stats"].get("gamma_history", [])]
    ttft = [r["ttft"] for r in results]
    queue = [r["stats"].get("queue_time_s", 0.0) for r in results]
    itl = [r["itl"] for r in results if r["tokens"] > 1]
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(errors), "error_samples": errors[:3],
        "retried": sum(r.get("retried", 0) for r in results),  # requests sent again on a new connection
        "wall_s": wall, "tokens": tokens, "aggregate_tokens_per_s": tokens / wall if wall else 0.0,
        "per_stream_tokens_per_s": statistics.mean(r["tokens"] / (r["end"] - r["start"]) for r in results)
        if results else 0.0,
        "ttft_p50_s": _quantile(ttft, 0.5), "ttft_p95_s": _quantile(ttft, 0.95),
        "queue_p50_s": _quantile(queue, 0.5), "queue_p95_s": _quantile(queue, 0.95),
        "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in results) if results else 0.0,
        "itl_p50_s": _quantile(itl, 0.5), "itl_p95_s": _quantile(itl, 0.95),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_gamma": statistics.mean(gammas) if gammas else 0.0,
        "controllers": sorted({r["stats"]["controller"] for r in results if r["stats"].get("controller")}),  # what
        # the server ran (in process: not reported)
        "tokens_per_round": sum(r["tokens"] for r in results) / max(1, len(gammas)),
    }


async def _with_long_prompt(base_url: str, concurrency: int, max_tokens: int, gamma, prompts: list[str],
                            length: int) -> dict:
    """A level of short streams while one `length`-token prompt (token ids, one answer token) is prefilled."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="-", timeout=1800, max_retries=0)
    model = (await client.models.list()).data[0].id
    ids = [1000 + (7 * i) % 20000 for i in range(length)]

    async def long() -> float:
        t0 = time.perf_counter()
        await client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0)
        return time.perf_counter() - t0

    task = asyncio.ensure_future(long())
    await asyncio.sleep(0.5)  # the long prefill is under way when the short streams start
    short = await _level(base_url, concurrency, 1, max_tokens, gamma, prompts)
    short["long_prompt_tokens"], short["long_prompt_s"] = length, await task
    await client.close()
    return short


async def _prefix_check(base_url: str, system: str, prompts: list[str], max_tokens: int, gamma) -> dict:
    """8 requests in a row sharing `system` (different questions; the first finds nothing cached), then a 4-turn
    chat under a system prompt of its own (each turn resends the conversation so far): TTFT and text of each."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="-", timeout=1800, max_retries=0)
    model = (await client.models.list()).data[0].id
    keep = ("ttft", "prompt_tokens", "text")
    singles = []
    for i in range(8):
        row = await _stream(client, model, prompts[i % len(prompts)], max_tokens, gamma, system)
        singles.append({k: row[k] for k in keep})
    turns, messages = [], [{"role": "system", "content": "Second desk. " + system}]
    for t in range(4):
        messages.append({"role": "user", "content": prompts[(t + 3) % len(prompts)]})
        row = await _stream(client, model, list(messages), max_tokens, gamma)
        turns.append({k: row[k] for k in keep})
        messages.append({"role": "assistant", "content": row["text"]})
    await client.close()
    rest = statistics.median(r["ttft"] for r in singles[1:])
    return {"requests": singles, "turns": turns, "ttft_first_s": singles[0]["ttft"], "ttft_rest_median_s": rest,
            "ttft_rest_over_first": rest / singles[0]["ttft"] if singles[0]["ttft"] else 0.0}


IN_PROCESS = "inprocess"


class _InProcess:
    """`--url inprocess`: the served target worker in this process, its `Generate` driven from threads."""

    def __init__(self, args):
        from specserve.engine.prompts import PromptCodec
        from specserve.models.formats.loading import load_tokenizer
        from specserve.serve.run import model_args
        from specserve.workers.actors import TargetWorkerActor
        from specserve.workers.config import WorkersConfig

        app = model_args(args, "auto")
        config = WorkersConfig(**{k: v for k, v in app.items() if k in WorkersConfig.model_fields})
        if not config.colocated():
            raise ValueError(f"--url {IN_PROCESS}: runs the sessions inside the target worker, so it needs a model "
                             f"draft there (--draft {config.draft!r} drafts elsewhere)")
        print(f"  loading the target worker in this process (target={config.target}, draft={config.draft}) ...",
              flush=True)
        self.worker = TargetWorkerActor(
            config.target, config.dtype, config.target_resources.threads(), None, config.scheduling(), config.draft,
            app["gamma_max"], config.draft_top_k, config.session_idle_s, None, config.quantization,
            config.draft_quantization)
        self.vocab = self.worker.info()["vocab"]
        self.codec = PromptCodec(load_tokenizer(config.target), self.vocab)
        self.ids = itertools.count()  # next() is atomic: the streams' threads share it

    def stop(self) -> None:
        self.worker.stop()
        self.worker.servicer.close()

    def stream(self, prompt: str | list[dict], max_tokens: int, gamma, system: str | None) -> dict:
        """One request as `_stream` sends it (greedy, eos ignored), on the calling thread."""
        from specserve.engine.stats import GenerationStats
        from specserve.rpc.convert import round_from_wire
        from specserve.v1 import workers_pb2

        messages = prompt if isinstance(prompt, list) else _messages(prompt, system)
        request = workers_pb2.SessionRequest(session_id=f"load-{next(self.ids)}", prompt_ids=self.codec.encode(messages),
                                             max_tokens=max_tokens, gamma=str(gamma if gamma is not None else "auto"))
        request.sampling.temperature, request.sampling.seed, request.sampling.ignore_eos = 0.0, 0, True
        t0 = time.perf_counter()
        first = None
        ids, recorded = [], GenerationStats()
        for reply in self.worker.servicer.Generate(request, _Live()):  # a message a round (no interval)
            first = first or time.perf_counter()
            for rnd in map(round_from_wire, reply.rounds):
                ids.extend(rnd.tokens)
                recorded.record(rnd)
        end = time.perf_counter()
        first = first or end
        stats, tokens = recorded.to_dict(), len(ids)
        return {"start": t0, "end": end, "ttft": first - t0, "tokens": tokens, "prompt_tokens": len(request.prompt_ids),
                "itl": (end - first) / (tokens - 1) if tokens > 1 else 0.0, "stats": stats,
                "text": self.codec.decode(ids) or ""}  # after the clock: the server's detokenizing is not timed here


class _Live:
    """The gRPC context `Generate` checks between rounds: a client that stays."""

    @staticmethod
    def is_active() -> bool:
        return True

    @staticmethod
    def abort(code, details):
        raise RuntimeError(f"{code}: {details}")


def _level_in_process(target: _InProcess, concurrency: int, requests: int, max_tokens: int, gamma,
                      prompts: list[str], system: str | None = None) -> dict:
    """`_level` against the in-process worker: one thread a stream (as the server's gRPC threads)."""
    import threading

    from specserve.scheduler.threads import one_thread_torch

    results: list[dict] = []
    errors: list[str] = []

    def stream(k: int) -> None:
        one_thread_torch()
        for r in range(requests):
            try:
                results.append(target.stream(prompts[(k + r) % len(prompts)], max_tokens, gamma, system))
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(exc).__name__}: {exc}"[:200])

    threads = [threading.Thread(target=stream, args=(k,), name=f"load-stream-{k}") for k in range(concurrency)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return _row(concurrency, results, errors, time.perf_counter() - t0)


def _start_servers(args, apps: set[str]) -> tuple[str, dict[str, str]]:
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from specserve.serve import build_app, ingress
    from specserve.serve.listen import free_port
    from specserve.serve.run import model_args
    from specserve.workers.quiet import quiet_env, yield_control_plane

    port = free_port()
    # one application at /: its replica answers HTTP itself, as `specserve serve`'s
    direct = apps == {"batched"} and ingress.ray_has_direct_ingress()
    if direct:
        replica_port = free_port()
        os.environ.update(ingress.direct_env(replica_port, free_port()))
    quiet_env()  # as `specserve serve` runs its local Ray (`workers.quiet`)
    ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=8)  # logical slots
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
    app_args = model_args(args, "auto")
    urls = {}
    for name in sorted(apps):
        prefix = "/" if name == "batched" else f"/{name}"
        print(f"  deploying the {name} application (draft={args.draft}) ...", flush=True)
        serve.run(build_app({**app_args, "batching": name != "unbatched", "prefix_caching": name != "uncached"}),
                  name=name, route_prefix=prefix)
        urls[name] = f"http://127.0.0.1:{replica_port if direct else port}{prefix.rstrip('/')}/v1"
    yield_control_plane(include_root=False)  # this driver runs the clients: it keeps its priority
    return port, urls


def run_load_bench(args) -> int:
    configs = list(dict.fromkeys(c for c in args.load_configs.split(",") if c))  # a name twice: --load-rounds
    unknown = sorted(set(configs) - set(CONFIGS))
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        levels = []
    rounds = args.load_rounds
    if unknown or not configs or not levels or min(levels) < 1 or args.load_requests < 1 or rounds < 1:
        print(f"specserve bench --load: --load-configs from {sorted(CONFIGS)} (got {unknown or configs}); "
              "--concurrency: positive integers; --load-requests and --load-rounds >= 1", file=sys.stderr)
        return 2
    in_process = args.url == IN_PROCESS
    if in_process and ({CONFIGS[c][0] for c in configs} != {"batched"} or args.long_prompt
                       or getattr(args, "system_prompt", 0)):
        print(f"specserve bench --load --url {IN_PROCESS}: the gamma0 and auto configurations only, without "
              "--long-prompt and --system-prompt", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = SUITE["chat"]
    started = args.url is None
    target = None
    if started:
        _, urls = _start_servers(args, {CONFIGS[c][0] for c in configs})
    elif in_process:
        try:
            target = _InProcess(args)
        except ValueError as exc:
            print(f"specserve bench --load: {exc}", file=sys.stderr)
            return 2
        urls = {}
    else:
        urls = {app: args.url.rstrip("/") for app, _ in CONFIGS.values()}

    def level_of(app: str, *rest) -> dict:
        if target is not None:
            return _level_in_process(target, *rest)
        return asyncio.run(_level(urls[app], *rest))

    system = system_prompt(args.system_prompt) if getattr(args, "system_prompt", 0) else None
    report = {"config": {"target": args.target, "draft": args.draft, "max_new_tokens": args.max_new_tokens,
                         "quantization": getattr(args, "quantization", "auto"),
                         "requests_per_stream": args.load_requests, "sampling": "greedy, eos ignored",
                         "url": args.url, "configs": configs, "concurrency": levels, "rounds": rounds,
                         "system_prompt_tokens": getattr(args, "system_prompt", 0)},
              "levels": {c: [] for c in configs}, "ratio_to_first": {c: [] for c in configs[1:]}}
    try:
        if system:
            report["prefix"] = _prefix_checks(urls, configs, system, prompts, args.max_new_tokens)
        for name in configs:  # warm every path once, and the prefix caches with every prompt
            app, gamma = CONFIGS[name]
            level_of(app, len(prompts), 1, 8, gamma, prompts, system)
        # rounds outermost, levels and configurations in ABBA order within them: a drift of the machine's speed
        # hits every level and configuration alike, so a round's ratios between them compare like with like
        runs: dict[int, dict[str, list[dict]]] = {level: {c: [] for c in configs} for level in levels}
        for r in range(rounds):
            for level in levels if r % 2 == 0 else levels[::-1]:
                for name in configs if r % 2 == 0 else configs[::-1]:
                    app, gamma = CONFIGS[name]
                    label = name if rounds == 1 else f"{name} ({r + 1}/{rounds})"
                    print(f"  concurrency {level:3d}  {label:15s} ...", end="", flush=True)
                    row = level_of(app, level, args.load_requests, args.max_new_tokens, gamma, prompts, system)
                    runs[level][name].append(row)
                    print(f" {row['aggregate_tokens_per_s']:7.1f} tok/s aggregate, "
                          f"{row['per_stream_tokens_per_s']:6.1f} per stream, TTFT p50/p95 {row['ttft_p50_s']:.2f}/"
                          f"{row['ttft_p95_s']:.2f} s (queue p50/p95 {row['queue_p50_s']:.2f}/"
                          f"{row['queue_p95_s']:.2f} s), ITL p50 {1000 * row['itl_p50_s']:.0f} ms, γ "
                          f"{row['mean_gamma']:.2f}, acceptance {row['acceptance_rate']:.2f}, errors {row['errors']}"
                          + (f" ({row['retried']} sent again on a new connection)" if row.get("retried") else ""),
                          flush=True)
            _tabulate(report, runs, configs, levels)
            (out / "load.json").write_text(json.dumps(report, indent=2))
        if args.long_prompt:
            app, gamma = CONFIGS[configs[0]]
            level = min(levels[-1], 4)
            print(f"  {level} short streams ({configs[0]}) while a {args.long_prompt}-token prompt is prefilled ...",
                  flush=True)
            alone = asyncio.run(_level(urls[app], level, 1, args.max_new_tokens, gamma, prompts))
            beside = asyncio.run(_with_long_prompt(urls[app], level, args.max_new_tokens, gamma, prompts,
                                                   args.long_prompt))
            report["long_prompt"] = {"without": alone, "with": beside}
            for name, row in report["long_prompt"].items():
                print(f"    {name:8s} long prompt: short TTFT p50/p95 {row['ttft_p50_s']:.2f}/{row['ttft_p95_s']:.2f}"
                      f" s, ITL p50/p95 {1000 * row['itl_p50_s']:.0f}/{1000 * row['itl_p95_s']:.0f} ms, errors "
                      f"{row['errors']}" + (f"; the long prompt's answer took {row['long_prompt_s']:.1f} s"
                                            if "long_prompt_s" in row else ""), flush=True)
            (out / "load.json").write_text(json.dumps(report, indent=2))
    finally:
        if target is not None:
            target.stop()
        if started:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    _summary(report)
    (out / "load.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "load.png")
    print(f"\nwrote {out / 'load.json'} and {out / 'load.png'}")
    return 0


def _tabulate(report: dict, runs: dict[int, dict[str, list[dict]]], configs: list[str], levels: list[int]) -> None:
    """report's levels (the median run of each), ratio_to_first (the median of the rounds' paired ratios to the
    first configuration) and scaling (of each level's aggregate to the first level's, paired by round), from the
    rounds run so far."""
    def paired(a: list[dict], b: list[dict]) -> dict:
        ratios = [x["aggregate_tokens_per_s"] / y["aggregate_tokens_per_s"] for x, y in zip(a, b)
                  if y["aggregate_tokens_per_s"]]
        return {"median": statistics.median(ratios) if ratios else 0.0, "runs": ratios}

    done = [level for level in levels if runs[level][configs[0]]]
    report["levels"] = {c: [_median_run(runs[level][c]) for level in done] for c in configs}
    report["ratio_to_first"] = {c: [{"concurrency": level, **paired(runs[level][c], runs[level][configs[0]])}
                                    for level in done] for c in configs[1:]}
    report["scaling"] = {c: [{"concurrency": level, **paired(runs[level][c], runs[levels[0]][c])}
                             for level in done[1:]] for c in configs} if len(done) > 1 else {}


def _prefix_checks(urls: dict[str, str], configs: list[str], system: str, prompts: list[str], max_tokens: int
                   ) -> dict:
    """`_prefix_check` on each server the configurations use (γ of the first configuration on it), printed."""
    out: dict[str, dict] = {}
    for name in configs:
        app, gamma = CONFIGS[name]
        if app in out:
            continue
        print(f"  {app}: 8 requests sharing a system prompt, then a 4-turn chat ...", flush=True)
        row = out[app] = asyncio.run(_prefix_check(urls[app], system, prompts, max_tokens, gamma))
        print(f"    prompt {row['requests'][0]['prompt_tokens']} tokens: TTFT first {row['ttft_first_s']:.2f} s, "
              f"requests 2-8 median {row['ttft_rest_median_s']:.2f} s ({row['ttft_rest_over_first']:.2f}x); chat "
              "turns " + ", ".join(f"{t['prompt_tokens']} tokens {t['ttft']:.2f} s" for t in row["turns"]), flush=True)
    if len(out) > 1:
        first, *others = out
        for other in others:
            same = [a["text"] == b["text"] for a, b in zip(out[first]["requests"] + out[first]["turns"],
                                                           out[other]["requests"] + out[other]["turns"])]
            out[f"same_text_{first}_{other}"] = same
            print(f"    answers equal between {first} and {other}: {sum(same)} of {len(same)}", flush=True)
    return out


def _median_run(runs: list[dict]) -> dict:
    """The run with the median aggregate tokens/s (the lower middle of an even count), every run's figure beside."""
    ordered = sorted(runs, key=lambda r: r["aggregate_tokens_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["runs_aggregate_tokens_per_s"] = [r["aggregate_tokens_per_s"] for r in runs]
    return row


def _summary(report: dict) -> None:
    configs = list(report["levels"])
    ratios = [f"{c}/{configs[0]}" for c in configs[1:]]
    many = report["config"].get("rounds", 1) > 1
    print(f"\n{'concurrency':>11s} " + " ".join(f"{c:>15s}" for c in configs + ratios)
          + ("   (aggregate tok/s: median run; ratios: median of the rounds' pairs)" if many
             else "   (aggregate tok/s)"))
    for i, level in enumerate(report["config"]["concurrency"]):
        print(f"{level:11d} " + " ".join([f"{report['levels'][c][i]['aggregate_tokens_per_s']:15.1f}" for c in configs]
                                         + [f"{report['ratio_to_first'][c][i]['median']:15.2f}" for c in configs[1:]]))
    first = report["config"]["concurrency"][0]
    for c, rows in report.get("scaling", {}).items():
        print(f"{c}: " + "; ".join(f"{r['concurrency']} streams / {first}: {r['median']:.2f}x" + (
            " (rounds " + ", ".join(f"{x:.2f}" for x in r["runs"]) + ")" if many else "") for r in rows))


def _plot(report: dict, path: pathlib.Path) -> None:
    """Aggregate tokens/s and TTFT p95 against concurrency, one line per configuration, values on the points;
    with several rounds a point is the median run and its whisker the range over the rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["config"]["concurrency"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for k, (name, rows) in enumerate(report["levels"].items()):
        offset = (0, 6) if k % 2 == 0 else (0, -13)  # alternate configurations' labels above and below their points
        xs = levels[: len(rows)]
        values = [r["aggregate_tokens_per_s"] for r in rows]
        runs = [r.get("runs_aggregate_tokens_per_s") or [v] for r, v in zip(rows, values)]
        spread = [[v - min(rs) for v, rs in zip(values, runs)], [max(rs) - v for v, rs in zip(values, runs)]]
        line = ax.errorbar(xs, values, yerr=spread, marker="o", capsize=3, label=f"{name} ({_describe(name)})")
        for x, y in zip(xs, values):
            ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=offset, ha="center", fontsize=7,
                        color=line[0].get_color())
        ttft = [r["ttft_p95_s"] for r in rows]
        ax2.plot(xs, ttft, marker="o", label=name, color=line[0].get_color())
        for x, y in zip(xs, ttft):
            ax2.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=offset, ha="center", fontsize=7,
                         color=line[0].get_color())
    for a, label, title in ((ax, "aggregate tokens/s (all streams)", "throughput"),
                            (ax2, "time to first token, p95 (s)", "latency")):
        a.set_xscale("log", base=2)
        a.set_xticks(levels, [str(x) for x in levels])
        a.set_xlabel("concurrent streams")
        a.set_ylabel(label)
        a.set_title(title, fontsize=10)
        a.set_ylim(bottom=0)
        a.legend(fontsize=8, title="configuration")
    c = report["config"]
    where = c["url"] or "a server started by the bench"
    fig.suptitle(f"load: target {c['target']} ({c.get('quantization', 'auto')} weights), draft {c['draft']}, "
                 f"{c['sampling']}, {c['max_new_tokens']} new tokens\n"
                 f"chat prompts, {c['requests_per_stream']} request(s) per stream, {where}"
                 + (f"; median of {c['rounds']} rounds (ABBA), whiskers: range" if c.get("rounds", 1) > 1 else ""),
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _describe(config: str) -> str:
    """What a --load-configs name runs, for the legend."""
    app, gamma = CONFIGS[config]
    depth = "γ=0, plain decoding" if gamma == 0 else f"γ {gamma}" if gamma is not None else "server's γ"
    return f"{depth}, {app}"
