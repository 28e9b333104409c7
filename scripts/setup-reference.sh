#!/usr/bin/env bash
# Create .venv-ref/ (gitignored) with the Python packages of the independent
# reference implementation (scripts/requirements-reference.txt). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv-ref/.requirements
if [ -x .venv-ref/bin/python ] && cmp -s scripts/requirements-reference.txt "$stamp"; then
    exit 0
fi
echo "setting up .venv-ref (numpy, gguf, safetensors, regex, jinja2, pandas, sentencepiece, protobuf)" >&2
python3 -m venv .venv-ref
.venv-ref/bin/python -m pip install --quiet --disable-pip-version-check -r scripts/requirements-reference.txt
cp scripts/requirements-reference.txt "$stamp"
