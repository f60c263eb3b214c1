#!/usr/bin/env bash
# The peer venv: speculators from the registry, beside eagle3 and never a dependency of it.
#   bash benchmarks/peer/setup.sh        -> benchmarks/peer/.venv
# CPU torch first (the local wheel), as eagle3's own setup does. speculators pulls torchvision and torchaudio
# builds for another torch, beside which `import transformers` fails ("operator torchvision::nms does not
# exist"); its EAGLE-3 training uses neither, so they are removed.
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip --disable-pip-version-check -q install torch==2.13.0 speculators==0.9.0
.venv/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio || true
.venv/bin/python -c "from speculators.train.trainer import Trainer; print('speculators ready')"
