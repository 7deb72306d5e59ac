"""The GPU checks of the fast steps and the feature head in one call: the CUDA tests, then the data-plane bench's head runs, each part under
its own time limit and all of them under one budget, and a verdict on each goal from the JSON they wrote.

    python -m specserve.bench.gpucheck --parts cold,warm --budget-s 560 --out $OUT   # a GPU machine's first command
    python -m specserve.bench.gpucheck --parts steps,tests --budget-s 300 --out $OUT  # its second (a warm machine)
    python -m specserve.bench.gpucheck --report call1 call2   # the goals from both calls' files, back here
    python -m specserve.bench.gpucheck --smoke --out /tmp/gpucheck   # the whole sequence on a CPU, tiny shapes

On a GPU machine with 15 minutes of time, its start included, at most 10 a command, this runs the measurements
in the order they matter, skips a part that its budget would not leave room for (and says so), and stops no
part mid-way but at its own limit. A GPU image may lack some wheels (docs/benchmarks.md "How to measure"):
download them on the CPU machine into `.whl/` and carry it; this installs them into /tmp/site first.

Parts, as docs/benchmarks.md runs them (7B shape, the synthetic feature head, alpha 0.7, defaults: steps
compiled and warmed up before serving, caches under $SPECSERVE_CACHE):
  tests   CUDA exactness: graph replay, compiled steps, head blocks (tests/cpu -k cuda)
  cold    a served worker's cold start, then load at 1, 16, 16, 64 streams, gamma 0 against auto
  warm    the same worker's warm start (graphs from the cache), one stream at gamma 0..4 and auto
  steps   the pooled step against its bandwidth floor, and one stream in process at each gamma
Writes gpucheck.json (each part's command, seconds, exit status; the goals and whether each holds) and the parts'
own dataplane.json/png under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

# (name, minimum seconds worth starting it with, its time limit, command after `python -m`), measurements first;
# the tests run with SPECSERVE_COMPILE_STEPS=0 (exactness, not the compile)
FULL = [
    ("cold", 300, 420, ["specserve.bench.dataplane", "--targets", "7b", "--draft-kind", "head", "--parts", "load",
                        "--load-alpha", "0.7", "--concurrency", "1,16,16,64", "--max-tokens", "128"]),
    ("warm", 90, 200, ["specserve.bench.dataplane", "--targets", "7b", "--draft-kind", "head", "--parts", "load",
                       "--load-alpha", "0.7", "--concurrency", "1", "--load-gammas", "0,1,2,3,4,auto",
                       "--max-tokens", "128"]),
    ("steps", 120, 300, ["specserve.bench.dataplane", "--targets", "7b", "--draft-kind", "head", "--parts",
                         "steps,gammas", "--step-modes", "compiled-dynamic", "--step-repeats", "10", "--concurrency",
                         "1,16,64", "--sweep-gammas", "0,2,3,4,auto", "--load-alpha", "0.7", "--max-tokens", "128"]),
    ("tests", 60, 150, ["pytest", "-q", "tests/cpu/test_runner.py", "tests/cpu/test_drafting.py",
                        "tests/cpu/test_head.py", "-k", "cuda"]),
]
# the same on a CPU in about a minute: tiny shapes, few tokens, the eager steps
SMOKE = [
    ("cold", 5, 120, ["specserve.bench.dataplane", "--targets", "tiny", "--draft-kind", "head", "--parts", "load",
                      "--load-alpha", "0.7", "--concurrency", "1,2", "--max-tokens", "16"]),
    ("warm", 5, 120, ["specserve.bench.dataplane", "--targets", "tiny", "--draft-kind", "head", "--parts", "load",
                      "--load-alpha", "0.7", "--concurrency", "1", "--load-gammas", "0,2,auto", "--max-tokens", "16"]),
    ("steps", 5, 120, ["specserve.bench.dataplane", "--targets", "tiny", "--draft-kind", "head", "--parts",
                       "steps,gammas", "--step-modes", "eager", "--step-repeats", "3", "--concurrency", "1",
                       "--sweep-gammas", "0,2,3,auto", "--load-alpha", "0.7", "--max-tokens", "16"]),
    ("tests", 5, 120, ["pytest", "-q", "tests/cpu/test_head.py", "-k", "greedy_through_a_head_equals"]),
]
# the goals: step at most 1.4x its floor; a head step at most 0.1x the verify; auto at
# least 2x its own gamma=0 in process; under load auto at least 0.97x gamma=0 at every level, above it at 16
# streams; a warm start within 60 s
STEP_OF_FLOOR, HEAD_OF_VERIFY, AUTO_SPEEDUP, LOAD_FLOOR, LOAD_ABOVE_AT, WARM_START_S = 1.4, 0.1, 2.0, 0.97, 16, 60.0


def install_wheels(root: pathlib.Path, site: pathlib.Path) -> bool:
    """Install `.whl/*.whl` (carried from the CPU machine) into `site`, saying what happened; whether `site` has
    them now (False where there are none)."""
    wheels = sorted((root / ".whl").glob("*.whl"))
    if not wheels:
        return False
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)],
                          check=False, capture_output=True, text=True)
    print(f"[gpucheck] installed {len(wheels)} wheels into {site}" if done.returncode == 0 else
          f"[gpucheck] installing the wheels failed: {done.stderr.strip()[-500:]}")
    return done.returncode == 0


def run_parts(parts, out: pathlib.Path, budget_s: float, env: dict[str, str], log=print) -> list[dict[str, Any]]:
    """Each part in order as a subprocess (its output in out/NAME.log), within its limit and what is left of the
    budget; a part its minimum does not fit in is skipped."""
    start, results = time.monotonic(), []
    for name, minimum, limit, args in parts:
        part_env = dict(env, SPECSERVE_COMPILE_STEPS="0") if name == "tests" else env
        left = budget_s - (time.monotonic() - start)
        command = [sys.executable, "-m", *args] + (["--out", str(out / name)] if args[0].endswith("dataplane") else [])
        if left < minimum:
            log(f"[gpucheck] {name}: skipped, {left:.0f} s of the budget left (it needs {minimum} s)")
            results.append({"part": name, "command": command, "skipped": True})
            continue
        timeout = min(limit, left)
        log(f"[gpucheck] {name}: {' '.join(args)} (up to {timeout:.0f} s)")
        t0 = time.monotonic()
        with open(out / f"{name}.log", "w") as f:
            try:
                rc = subprocess.run(command, check=False, stdout=f, stderr=subprocess.STDOUT, env=part_env,
                                    timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = None
        seconds = time.monotonic() - t0
        log(f"[gpucheck] {name}: {'timed out' if rc is None else f'exit {rc}'} after {seconds:.0f} s")
        results.append({"part": name, "command": command, "seconds": round(seconds, 1), "returncode": rc})
    return results


def _written(outs: list[pathlib.Path], part: str) -> dict[str, Any]:
    """`part`'s dataplane.json in the first of `outs` that has one ({} where none does)."""
    for out in outs:
        path = out / part / "dataplane.json"
        if path.exists():
            return json.loads(path.read_text())
    return {}


def _rows(outs: list[pathlib.Path], part: str, key: str) -> list[dict[str, Any]]:
    return _written(outs, part).get(key, [])


def _goal(name: str, value: float | None, target: float, at_most: bool, detail: str = "") -> dict[str, Any]:
    holds = None if value is None else (value <= target if at_most else value >= target)
    return {"goal": name, "value": None if value is None else round(value, 3),
            "target": f"{'<=' if at_most else '>='} {target}", "holds": holds, "detail": detail}


def verdicts(*outs: pathlib.Path) -> list[dict[str, Any]]:
    """The goals from the parts' dataplane.json under `outs` (one call's --out, or several calls' together; a goal
    whose part did not run or write its figure: holds None)."""
    goals = []
    written = _written(outs, "steps")
    target = (written.get("args", {}).get("targets") or [None])[0]  # its steps part times the draft's shape too
    steps = [r for r in written.get("steps", []) if r.get("sequences") == 1 and r.get("width") == 1
             and r.get("shape") in (target, None)]
    goals.append(_goal("gamma=0 step / bandwidth floor", steps[0]["of_floor"] if steps else None, STEP_OF_FLOOR,
                       True, f"{steps[0]['step_ms']:.2f} ms, floor {steps[0]['floor_ms']:.2f} ms" if steps else ""))
    gammas = {r["gamma"]: r for r in _rows(outs, "steps", "gammas") if r.get("streams", 1) == 1}
    fixed = [g for g in gammas if isinstance(g, int) and g > 0]
    if fixed:
        g = max(fixed)
        r = gammas[g]
        ratio = r["draft_ms_per_round"] / g / r["verify_ms_per_round"] if r["verify_ms_per_round"] else None
        goals.append(_goal("head draft step / verify step", ratio, HEAD_OF_VERIFY, True,
                           f"gamma={g}: {r['draft_ms_per_round'] / g:.3f} ms a drafted token, "
                           f"verify {r['verify_ms_per_round']:.2f} ms"))
    else:
        goals.append(_goal("head draft step / verify step", None, HEAD_OF_VERIFY, True))
    base, auto = gammas.get(0), gammas.get("auto")
    goals.append(_goal("auto / gamma=0, one stream in process", auto["tok_s"] / base["tok_s"] if base and auto else None,
                       AUTO_SPEEDUP, False,
                       f"{auto['tok_s']:.1f} / {base['tok_s']:.1f} tok/s" if base and auto else ""))
    load: dict[int, dict[Any, list[float]]] = {}
    for r in _rows(outs, "cold", "load"):
        load.setdefault(r["streams"], {}).setdefault(r["gamma"], []).append(r["tok_s"])
    for streams in sorted(load):
        zero, auto_s = load[streams].get(0), load[streams].get("auto")
        ratio = max(auto_s) / max(zero) if zero and auto_s else None
        target = LOAD_FLOOR if streams != LOAD_ABOVE_AT else 1.0
        goals.append(_goal(f"load: auto / gamma=0 at {streams} streams", ratio, target, False,
                           f"{max(auto_s):.1f} / {max(zero):.1f} tok/s (best of {len(zero)})" if ratio else ""))
    for part, name in (("cold", "cold start, s"), ("warm", "warm start, s")):
        starts = _rows(outs, part, "startup")
        value = starts[0]["start_s"] if starts else None
        goals.append(_goal(name, value, WARM_START_S, True) if part == "warm" else
                     {"goal": name, "value": None if value is None else round(value, 1), "target": "(reported)",
                      "holds": None, "detail": ""})
    return goals


def report(goals: list[dict[str, Any]], device: str) -> None:
    print(f"\n[gpucheck] {device}")
    for g in goals:
        mark = {True: "holds", False: "NOT MET", None: "no figure"}[g["holds"]]
        value = "-" if g["value"] is None else g["value"]
        print(f"  {g['goal']:42s} {value!s:>9} {g['target']:>12}  {mark:9s} {g['detail']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.bench.gpucheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpucheck-out")
    p.add_argument("--budget-s", type=float, default=540.0, help="seconds for every part together")
    p.add_argument("--parts", default="cold,warm,steps,tests", help="a subset (they run in this order)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens: the sequence on a CPU")
    p.add_argument("--report", nargs="+", metavar="DIR", help="run nothing: the goals from these calls' --out")
    args = p.parse_args(argv)
    if args.report:
        report(verdicts(*map(pathlib.Path, args.report)), "from " + ", ".join(args.report))
        return 0
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(__file__).resolve().parents[3]  # the repository: services/specserve/bench/gpucheck.py
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("SPECSERVE_CACHE", "/tmp/sscache")  # not under --out: compile caches are ~300 MB
    site = pathlib.Path("/tmp/site")
    paths = [str(site)] if install_wheels(root, site) else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(root / "services"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    wanted = {w.strip() for w in args.parts.split(",") if w.strip()}
    unknown = wanted - {part[0] for part in FULL}
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(part[0] for part in FULL)}")
    results = run_parts([part for part in (SMOKE if args.smoke else FULL) if part[0] in wanted], out, args.budget_s,
                        env)
    try:
        device = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                check=False, capture_output=True, text=True).stdout.strip()
    except OSError:
        device = "no nvidia-smi"
    goals = verdicts(out)
    (out / "gpucheck.json").write_text(json.dumps({"device": device, "parts": results, "goals": goals}, indent=2))
    report(goals, device)
    print(f"wrote {out / 'gpucheck.json'}")
    return 0 if all(r.get("returncode") == 0 for r in results if not r.get("skipped")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
