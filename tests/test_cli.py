import subprocess
import sys

from etgraph import __version__


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "etgraph", *args], capture_output=True, text=True, timeout=300
    )


def test_version_and_help():
    out = run_cli("--version")
    assert out.returncode == 0
    assert __version__ in out.stdout
    out = run_cli("--help")
    assert out.returncode == 0
    assert "Usage" in out.stdout
