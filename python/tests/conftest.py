import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def cli() -> Path:
    """The kvreplay binary: $KVREPLAY_BIN, else the workspace's release build."""
    if os.environ.get("KVREPLAY_BIN"):
        return Path(os.environ["KVREPLAY_BIN"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "release" / "kvreplay"


@pytest.fixture(scope="session")
def kvreplay_bin() -> Path:
    b = cli()
    if not b.is_file():
        pytest.skip(f"{b} is missing: run `cargo build --release` first")
    return b


@pytest.fixture(scope="session")
def smol_trace(tmp_path_factory, kvreplay_bin) -> Path:
    """A real SmolLM2 trace (passkey, 512 tokens, 8 decode steps), captured
    once per session with the CLI ($KVREPLAY_TEST_TRACE reuses one)."""
    if os.environ.get("KVREPLAY_TEST_TRACE"):
        return Path(os.environ["KVREPLAY_TEST_TRACE"])
    if not MODEL.is_file():
        pytest.skip(f"{MODEL} is missing: run scripts/fetch-model.sh")
    out = tmp_path_factory.mktemp("traces") / "passkey.kvtrace"
    subprocess.run(
        [str(kvreplay_bin), "capture", "--model", str(MODEL), "--task", "passkey:length=512",
         "--decode", "8", "--out", str(out)],
        check=True, capture_output=True,
    )
    return out


def run_cli(bin_: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_), *args], check=True, capture_output=True, text=True)
