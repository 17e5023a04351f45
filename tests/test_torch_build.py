"""scripts/torch_build.sh, which `make install` asks which torch to install: the driver → CUDA build
mapping, fed fake driver versions (and a fake nvidia-smi), and the CPU build where there is no driver."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "torch_build.sh"
BASH = shutil.which("bash") or "/bin/bash"
GPU = "torch>=2.11,<2.15 --index-url https://download.pytorch.org/whl/"


def _run(args: list[str], path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = None if path is None else {"PATH": path}
    return subprocess.run([BASH, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=30)


@pytest.mark.parametrize(("driver", "cuda"), [("590.48.01", "cu130"), ("580.65.06", "cu130"), ("575.57.08", "cu128"),
                                              ("570.86.15", "cu128"), ("565.57.01", "cu126"), ("560.28.03", "cu126")])
def test_the_driver_picks_the_newest_cuda_build_it_supports(driver: str, cuda: str):
    out = _run([driver])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == GPU + cuda
    assert f"NVIDIA driver {driver}: installing the CUDA build {cuda}" in out.stderr


@pytest.mark.parametrize("driver", ["555.42.06", "470.256.02"])
def test_an_old_driver_is_an_error_naming_the_minimum(driver: str):
    out = _run([driver])
    assert out.returncode == 1 and out.stdout == ""
    assert f"driver {driver} is too old" in out.stderr and ">= 560" in out.stderr


def test_an_unreadable_driver_version_is_an_error():
    out = _run(["N/A"])
    assert out.returncode == 1 and "cannot read the NVIDIA driver version" in out.stderr


def _bin(tmp_path: Path, nvidia_smi: str | None) -> str:
    """A PATH with nothing but, when given, a fake nvidia-smi printing that (the script needs only bash)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if nvidia_smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!{BASH}\n[[ \"$*\" == *driver_version* ]] && printf '{nvidia_smi}'\n")
        fake.chmod(0o755)
    return str(bin_dir)


def test_nvidia_smi_is_read_for_the_driver(tmp_path: Path):
    out = _run([], path=_bin(tmp_path, " 572.16\n572.16\n"))  # one line per GPU
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == GPU + "cu128"


def test_without_nvidia_smi_the_cpu_build_is_installed(tmp_path: Path):
    out = _run([], path=_bin(tmp_path, None))
    assert out.returncode == 0 and out.stdout.strip() == "torch==2.13.0"
    assert "no NVIDIA driver" in out.stderr


def test_the_cpu_build_comes_from_the_index_the_user_names(tmp_path: Path):
    env = {"PATH": _bin(tmp_path, None), "TORCH_CPU_INDEX": "https://download.pytorch.org/whl/cpu"}
    out = subprocess.run([BASH, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
