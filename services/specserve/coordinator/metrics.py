"""Prometheus metrics of the serving path, recorded by the coordinator through `ray.util.metrics`.

Every Ray node's metrics agent serves them at its metrics export port
(`ray start --metrics-export-port=8080`; KubeRay opens 8080 by default;
`specserve serve --metrics-port`). Ray prefixes application metrics with
`ray_` and Prometheus adds `_total` to counters, so `specserve_requests`
is scraped as `ray_specserve_requests_total`. Names follow vLLM's
(`vllm:spec_decode_num_draft_tokens` → `specserve_spec_decode_num_draft_tokens`).

Ray exports a histogram's sum from bucket midpoints, so a mean must come
from counters (e.g. mean γ = drafted tokens / drafts), not from `_sum/_count`.
`deploy/grafana/specserve.json` is built over `exported_names()`; a test checks it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.engine.loop import Round

PREFIX = "specserve_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # without PREFIX
    kind: str  # counter | gauge | histogram
    description: str
    tags: tuple[str, ...] = ("model",)
    buckets: tuple[float, ...] = ()

    def __post_init__(self):
        if not self.description.isascii():  # Ray's metric recorder takes ASCII only
            raise ValueError(f"{self.name}: description must be ASCII")

    @property
    def full_name(self) -> str:
        return PREFIX + self.name

    def series(self) -> tuple[str, ...]:
        """The series names a Prometheus scrape of a Ray node shows for this metric."""
        base = "ray_" + self.full_name
        if self.kind == "counter":
            return (base + "_total",)
        if self.kind == "histogram":
            return (base + "_bucket", base + "_sum", base + "_count")
        return (base,)


def gamma_buckets(gamma_max: int) -> tuple[float, ...]:
    """Half-integer bounds, so each γ = 0..gamma_max has a bucket of its own (le="2.5" counts γ ≤ 2)."""
    return tuple(g + 0.5 for g in range(gamma_max + 1))


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("requests", "counter", "Finished requests, by finish reason (stop, length, cancelled, error).",
               ("model", "finish_reason")),
    MetricSpec("prompt_tokens", "counter", "Prompt tokens of started requests."),
    MetricSpec("generation_tokens", "counter", "Tokens generated and handed to clients."),
    MetricSpec("spec_decode_num_drafts", "counter", "Rounds in which the draft proposed at least one token."),
    MetricSpec("spec_decode_num_draft_tokens", "counter", "Tokens the draft proposed."),
    MetricSpec("spec_decode_num_accepted_tokens", "counter", "Proposed tokens the target accepted."),
    MetricSpec("spec_decode_num_draft_tokens_per_pos", "counter",
               "Rounds that proposed a token at this position (1 = first drafted token).", ("model", "position")),
    MetricSpec("spec_decode_num_accepted_tokens_per_pos", "counter",
               "Rounds whose token at this position was accepted; / draft_tokens_per_pos = acceptance at that "
               "position.", ("model", "position")),
    MetricSpec("spec_decode_rounds", "counter", "Speculation rounds (one target verify each)."),
    MetricSpec("gamma", "histogram", "Speculation depth (gamma) chosen per round.", buckets=gamma_buckets(8)),
    MetricSpec("round_time_seconds", "histogram", "Wall time of one round as the coordinator sees it.",
               buckets=LATENCY_BUCKETS),
    MetricSpec("draft_call_seconds", "histogram", "Time of the round's draft proposal (a gRPC call to the draft "
               "worker, or the local n-gram lookup).", buckets=LATENCY_BUCKETS),
    MetricSpec("verify_call_seconds", "histogram", "Time of the round's target Verify gRPC call.",
               buckets=LATENCY_BUCKETS),
    MetricSpec("time_to_first_token_seconds", "histogram", "From the coordinator accepting the request to its "
               "first generated token (prefill included).", buckets=LATENCY_BUCKETS),
    MetricSpec("inter_token_latency_seconds", "histogram", "Time between tokens handed out: a round's gap since "
               "the previous one, divided over the tokens it produced (one observation per token).",
               buckets=LATENCY_BUCKETS),
    MetricSpec("e2e_request_latency_seconds", "histogram", "From accepting the request to its last token.",
               buckets=REQUEST_BUCKETS),
    MetricSpec("active_sessions", "gauge", "Sessions this coordinator is running now."),
    MetricSpec("num_requests_waiting", "gauge", "Requests waiting for a session slot (max_queued bounds them)."),
    MetricSpec("request_queue_time_seconds", "histogram", "How long a request waited for a session slot (0 when "
               "one was free).", buckets=LATENCY_BUCKETS),
    MetricSpec("requests_refused", "counter", "Requests refused with 503: the waiting queue was full, or they "
               "waited queue_timeout_s."),
    MetricSpec("session_resumes", "counter", "Times a session lost a worker and went on from its committed tokens "
               "on the worker's replacement."),
)


# recorded by the workers from their KV pools' statistics (`PoolMetrics`), counted in tokens as vLLM's are
POOL_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("prefix_cache_queries", "counter", "Prompt tokens looked up in a worker's prefix cache (role: target "
               "or draft).", ("model", "role")),
    MetricSpec("prefix_cache_hits", "counter", "Prompt tokens whose keys and values came from the prefix cache "
               "(hits / queries = hit rate).", ("model", "role")),
    MetricSpec("prefix_cache_evictions", "counter", "Cached prefixes evicted to make room in a KV pool.",
               ("model", "role")),
    MetricSpec("prefix_cache_tokens", "gauge", "Tokens the prefix cache holds now.", ("model", "role")),
)


def exported_names() -> set[str]:
    """Every series name a scrape can show (what dashboards may query)."""
    return {s for m in METRICS + POOL_METRICS for s in m.series()}


def _ray_metrics(specs: tuple[MetricSpec, ...], model: str, gamma_max: int = 8) -> dict:
    from ray.util.metrics import Counter, Gauge, Histogram

    out = {}
    for spec in specs:
        if spec.kind == "counter":
            metric = Counter(spec.full_name, description=spec.description, tag_keys=spec.tags)
        elif spec.kind == "gauge":
            metric = Gauge(spec.full_name, description=spec.description, tag_keys=spec.tags)
        else:
            buckets = gamma_buckets(gamma_max) if spec.name == "gamma" else spec.buckets
            metric = Histogram(spec.full_name, description=spec.description, boundaries=list(buckets),
                               tag_keys=spec.tags)
        metric.set_default_tags({"model": model})
        out[spec.name] = metric
    return out


class PoolMetrics:
    """A worker's prefix-cache counters, published from its pools' running totals (`KVPool.describe`)."""

    COUNTERS = {"prefix_cache_queries": "prefix_cache_query_tokens", "prefix_cache_hits": "prefix_cache_hit_tokens",
                "prefix_cache_evictions": "prefix_cache_evictions"}

    def __init__(self, model: str):
        self._m = _ray_metrics(POOL_METRICS, model)
        self._last: dict[tuple[str, str], float] = {}

    def publish(self, role: str, described: dict) -> None:
        if not described.get("prefix_caching"):
            return
        for name, key in self.COUNTERS.items():
            delta = described[key] - self._last.get((role, name), 0)
            self._last[(role, name)] = described[key]
            if delta > 0:
                self._m[name].inc(delta, tags={"role": role})
        self._m["prefix_cache_tokens"].set(described["prefix_cache_tokens"], tags={"role": role})


class ServingMetrics:
    """The Ray metric objects of one coordinator (create inside the Ray worker that records them)."""

    def __init__(self, model: str, gamma_max: int):
        self._m = _ray_metrics(METRICS, model, gamma_max)

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        if value:
            self._m[name].inc(value, tags=tags or None)

    def observe(self, name: str, value: float) -> None:
        self._m[name].observe(value)

    def set(self, name: str, value: float) -> None:
        self._m[name].set(value)


class SessionMetrics:
    """Records one session's rounds; `metrics` None (no Ray worker, e.g. in-process tests) records nothing."""

    def __init__(self, metrics: ServingMetrics | None, prompt_tokens: int):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.rounds = 0
        if metrics:
            metrics.inc("prompt_tokens", prompt_tokens)

    def round_done(self, rnd: Round) -> None:
        """Record one round of the session as the coordinator hands it over."""
        m = self.metrics
        if m is None:
            return
        now = time.perf_counter()
        gap, self.last = now - self.last, now
        self.rounds += 1
        new_tokens = len(rnd.tokens)
        if self.rounds == 1:  # the first round's gap includes prefill
            m.observe("time_to_first_token_seconds", now - self.start)
            gap -= rnd.prefill_time_s
        else:
            for _ in range(new_tokens):
                m.observe("inter_token_latency_seconds", gap / new_tokens)
        drafted, accepted = len(rnd.drafted), rnd.accepted
        m.inc("generation_tokens", new_tokens)
        m.inc("spec_decode_rounds")
        m.inc("spec_decode_num_drafts", int(drafted > 0))
        m.inc("spec_decode_num_draft_tokens", drafted)
        m.inc("spec_decode_num_accepted_tokens", accepted)
        for i in range(drafted):
            m.inc("spec_decode_num_draft_tokens_per_pos", position=str(i + 1))
            m.inc("spec_decode_num_accepted_tokens_per_pos", int(i < accepted), position=str(i + 1))
        m.observe("gamma", rnd.gamma)
        m.observe("round_time_seconds", max(gap, 0.0))
        m.observe("draft_call_seconds", rnd.draft_time_s)
        m.observe("verify_call_seconds", rnd.verify_time_s)

    def resumed(self) -> None:
        if self.metrics is not None:
            self.metrics.inc("session_resumes")

    def finished(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.inc("requests", finish_reason=reason)
            self.metrics.observe("e2e_request_latency_seconds", time.perf_counter() - self.start)


KEPT_LABELS = {tag for m in METRICS + POOL_METRICS for tag in m.tags} | {"le"}  # Ray adds its own (node, worker, session, ...)


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """specserve's series from a Prometheus endpoint, summed over Ray's own labels (workers, nodes).

    Keys look like `ray_specserve_requests_total{finish_reason="length",model="tiny"}`.
    """
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("ray_" + PREFIX):
                continue
            labels = sorted((k, v) for k, v in sample.labels.items() if k in KEPT_LABELS)
            key = sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "")
            values[key] = values.get(key, 0.0) + sample.value
    return values


def total(values: dict[str, float], series: str, **labels: str) -> float:
    """Sum of a scraped series over the label sets that match `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for key, v in values.items()
               if key.split("{")[0] == series and all(w in key for w in want))


def since(values: dict[str, float], baseline: dict[str, float]) -> dict[str, float]:
    """What was recorded after `baseline` was scraped (counters and histogram buckets only grow; a series gone
    from `values`, a stopped worker's, drops out)."""
    return {k: v - baseline.get(k, 0.0) for k, v in values.items()}


def scrape_until(url: str, series: str, at_least: float, timeout: float = 60.0, baseline: dict[str, float] | None = None,
                 **labels: str) -> dict[str, float]:
    """Scrape until `series` reaches `at_least` (Ray exports every few seconds), counting only what came after
    `baseline` if given; the last scrape either way."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            values = scrape(url)
        except OSError:  # the metrics agent may not listen yet
            values = {}
        if total(since(values, baseline or {}), series, **labels) >= at_least or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def _buckets(values: dict[str, float], series: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a scraped histogram, summed over label sets, sorted."""
    counts: dict[float, float] = {}
    for key, v in values.items():
        if key.split("{")[0] == series + "_bucket":
            le = key.split('le="')[1].split('"')[0]
            bound = float("inf") if le == "+Inf" else float(le)
            counts[bound] = counts.get(bound, 0.0) + v
    return sorted(counts.items())


def quantile(values: dict[str, float], series: str, q: float) -> float | None:
    """Prometheus' histogram_quantile over a scraped histogram (linear within the bucket)."""
    buckets = _buckets(values, series)
    if not buckets or buckets[-1][1] == 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = bound, count
    return lower


def metrics_summary(values: dict[str, float], requests_sent: int | None = None) -> dict:
    """The headline numbers of a scrape (what the Grafana dashboard shows), for bench reports."""
    series = {m.name: m.series()[0] for m in METRICS}
    drafted, accepted = total(values, series["spec_decode_num_draft_tokens"]), total(
        values, series["spec_decode_num_accepted_tokens"])
    gamma = _buckets(values, "ray_" + PREFIX + "gamma")
    per_gamma, below = {}, 0.0
    for bound, count in gamma:
        if bound != float("inf") and count - below:
            per_gamma[int(bound - 0.5)] = count - below
        below = count
    positions = sorted({int(k.split('position="')[1].split('"')[0]) for k in values if 'position="' in k})
    summary = {
        "requests": total(values, series["requests"]),
        "requests_sent": requests_sent,
        "prompt_tokens": total(values, series["prompt_tokens"]),
        "generation_tokens": total(values, series["generation_tokens"]),
        "rounds": total(values, series["spec_decode_rounds"]),
        "drafts": total(values, series["spec_decode_num_drafts"]),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_per_position": {
            p: total(values, series["spec_decode_num_accepted_tokens_per_pos"], position=str(p))
            / max(total(values, series["spec_decode_num_draft_tokens_per_pos"], position=str(p)), 1)
            for p in positions},
        "gamma_rounds": per_gamma,
        "mean_gamma": sum(g * n for g, n in per_gamma.items()) / sum(per_gamma.values()) if per_gamma else None,
        "active_sessions": total(values, series["active_sessions"]),
    }
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "round_time_seconds",
                 "draft_call_seconds", "verify_call_seconds", "e2e_request_latency_seconds"):
        for q in (0.5, 0.95):
            summary[f"{name.removesuffix('_seconds')}_p{int(q * 100)}_s"] = quantile(values, "ray_" + PREFIX + name, q)
    return summary
