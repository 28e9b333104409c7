#!/usr/bin/env bash
# The Python package's tests: build the wheel (python/, maturin, abi3) into
# the virtual environment .venv-py/ (made on first use, with maturin, numpy,
# pytest and pandas from PyPI), then run pytest on python/tests. The tests
# capture a SmolLM2 trace with target/release/kvreplay (built here if
# missing) and models/SmolLM2-135M-Instruct.Q4_1.gguf (scripts/fetch-model.sh).
# Extra arguments go to pytest. Prints pytest's summary line last.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-py
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.5,<2" numpy pytest pandas
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
# scripts/test.sh sets KVREPLAY_BIN_BUILT after its `cargo test --workspace
# --release` has built target/release/kvreplay: `cargo build -p kvreplay`
# alone resolves other features for the shared crates and would compile the
# workspace a second time.
if [ -z "${KVREPLAY_BIN_BUILT:-}" ]; then
    cargo build --release -q -p kvreplay
fi
wheels="$CARGO_TARGET_DIR/wheels"
rm -f "$wheels"/kvreplay-*.whl
"$venv/bin/maturin" build --release -q -m python/Cargo.toml -i "$venv/bin/python" -o "$wheels"
"$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$wheels"/kvreplay-*.whl
"$venv/bin/python" -m pytest -q -p no:cacheprovider -rs python/tests "$@"
