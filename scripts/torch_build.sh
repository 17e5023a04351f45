#!/usr/bin/env bash
# Which torch `make install` installs: prints pip's arguments on stdout and the choice on stderr.
#   scripts/torch_build.sh            # reads the driver from nvidia-smi
#   scripts/torch_build.sh 570.86.15  # as if that driver were installed (the tests use this)
# Without an NVIDIA driver: the CPU build torch==2.13.0. With one: a CUDA build of torch 2.11-2.14 from
# the PyTorch index that the driver can run (each CUDA toolkit's minimum Linux driver):
#   driver >= 580 -> cu130 (torch 2.11-2.14)    driver >= 570 -> cu128 (only torch 2.11 ships it)
#   driver >= 560 -> cu126 (torch 2.11-2.14)    older         -> an error naming the minimum
# pip takes the newest torch in the range that the chosen index has.
# TORCH_CPU_INDEX (make TORCH_CPU_INDEX=…): the index the CPU build comes from, for hosts whose default index
# serves torch's CUDA build (PyPI does: ≈ 2.7 GB with its NVIDIA packages), e.g. $INDEX/cpu.
set -euo pipefail

CPU_SPEC="torch==2.13.0"
GPU_SPEC="torch>=2.11,<2.15"
INDEX="https://download.pytorch.org/whl"
MIN_DRIVER=560

driver="${1:-}"
if [[ -z "$driver" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    # The first GPU's line (no `head` in a pipe: under pipefail its early exit could fail nvidia-smi).
    out="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null)" || out=""
    driver="${out%%$'\n'*}"
    driver="${driver//[[:space:]]/}"
  fi
  if [[ -z "$driver" ]]; then
    from="${TORCH_CPU_INDEX:+ from $TORCH_CPU_INDEX}"
    echo "pentatron: no NVIDIA driver found (nvidia-smi): installing the CPU build $CPU_SPEC$from" >&2
    echo "$CPU_SPEC${TORCH_CPU_INDEX:+ --index-url $TORCH_CPU_INDEX}"
    exit 0
  fi
fi

major="${driver%%.*}"
if ! [[ "$major" =~ ^[0-9]+$ ]]; then
  echo "pentatron: cannot read the NVIDIA driver version from '$driver'; install torch yourself" \
       "(pip install '$GPU_SPEC' --index-url $INDEX/cu126) and rerun make" >&2
  exit 1
fi
if (( major >= 580 )); then cuda=cu130
elif (( major >= 570 )); then cuda=cu128
elif (( major >= MIN_DRIVER )); then cuda=cu126
else
  echo "pentatron: NVIDIA driver $driver is too old: the CUDA builds of torch 2.11-2.14 need driver" \
       ">= $MIN_DRIVER (CUDA 12.6); update the driver, or install a CPU build with: pip install $CPU_SPEC" >&2
  exit 1
fi
echo "pentatron: NVIDIA driver $driver: installing the CUDA build $cuda of $GPU_SPEC ($INDEX/$cuda)" >&2
echo "$GPU_SPEC --index-url $INDEX/$cuda"
