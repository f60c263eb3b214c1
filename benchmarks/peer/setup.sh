#!/usr/bin/env bash
# The peer venv: speculators from the registry, beside eagle3 and never a dependency of it.
#   bash benchmarks/peer/setup.sh        -> $PEER_VENV (default ~/.cache/eagle3-peer/venv)
# Outside the work tree: the repo's linters and scanners never walk a third-party install.
# CPU torch first (the local wheel), as eagle3's own setup does. speculators pulls torchvision and torchaudio
# builds for another torch, beside which `import transformers` fails ("operator torchvision::nms does not
# exist"); its EAGLE-3 training uses neither, so they are removed.
set -euo pipefail
V="${PEER_VENV:-$HOME/.cache/eagle3-peer/venv}"
[ -x "$V/bin/python" ] || python3 -m venv "$V"
"$V/bin/python" -m pip --disable-pip-version-check -q install torch==2.13.0 speculators==0.9.0
"$V/bin/python" -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio || true
"$V/bin/python" -c "from speculators.train.trainer import Trainer; print('speculators ready')"
echo "$V"
