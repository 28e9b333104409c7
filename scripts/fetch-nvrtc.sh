#!/usr/bin/env bash
# Fetch NVIDIA's runtime compiler (libnvrtc.so.12 and its builtins) from the
# PyPI wheel nvidia-cuda-nvrtc-cu12==12.9.86 with the ordinary pip client, so
# the CUDA kernels can be compile-checked on a machine with no GPU and no CUDA
# toolkit. Unpacks into .cache/nvrtc/ (gitignored) and prints the path to set
# as KVREPLAY_NVRTC_LIB. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=12.9.86
DEST=.cache/nvrtc
LIB=$DEST/libnvrtc.so.12
if [ -f "$DEST/.complete-$VERSION" ]; then
    echo "$PWD/$LIB"
    exit 0
fi
echo "fetching libnvrtc (pip download nvidia-cuda-nvrtc-cu12==$VERSION, ~90 MB)" >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp" "nvidia-cuda-nvrtc-cu12==$VERSION"
python3 - "$tmp" <<'PY'
import glob, os, sys, zipfile
tmp = sys.argv[1]
whl = glob.glob(f"{tmp}/nvidia_cuda_nvrtc_cu12-*.whl")[0]
z = zipfile.ZipFile(whl)
# the library and its builtins; the `.alt` duplicate is not needed
names = [n for n in z.namelist() if "/lib/libnvrtc" in n and not n.endswith(".alt.so.12")]
for n in names:
    z.extract(n, tmp)
    os.replace(os.path.join(tmp, n), os.path.join(tmp, os.path.basename(n)))
print(" ".join(os.path.basename(n) for n in names), file=sys.stderr)
PY
rm -rf "$DEST"
mkdir -p "$DEST"
mv "$tmp"/libnvrtc* "$DEST"/
[ -f "$LIB" ] || { echo "error: the wheel held no libnvrtc.so.12" >&2; exit 1; }
touch "$DEST/.complete-$VERSION"
echo "$PWD/$LIB"
