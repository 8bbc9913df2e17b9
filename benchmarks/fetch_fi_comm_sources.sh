#!/usr/bin/env bash
# Writes .fi_csrc/: the CUDA sources of FlashInfer's TensorRT-LLM all-reduce fusion (the `trtllm_comm`
# JIT module behind flashinfer.comm.trtllm_allreduce_fusion), which ../shared/gpu/make-wheels.sh
# drops when it slims the wheel. gpu_run.sh copies them into the installed package on the GPU machine;
# carry .fi_csrc with the run. Usage (from the project root): bash benchmarks/fetch_fi_comm_sources.sh
set -euo pipefail
ver="${FI_VERSION:-0.7.2.post1}"
tmp="$(mktemp -d)"
python3 -m pip download -q --no-deps -d "$tmp" "flashinfer-python==$ver"
mkdir -p .fi_csrc
python3 - "$tmp"/flashinfer_python-*.whl <<'PY'
import sys, zipfile
names = ("trtllm_allreduce.cu", "trtllm_allreduce_fusion.cu", "trtllm_moe_allreduce_fusion.cu")
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in names:
        with open(f".fi_csrc/{n}", "wb") as f:
            f.write(z.read(f"flashinfer/data/csrc/{n}"))
PY
rm -rf "$tmp"
grep -qx ".fi_csrc/" "$(git rev-parse --git-path info/exclude)" || echo ".fi_csrc/" >> "$(git rev-parse --git-path info/exclude)"
ls -la .fi_csrc
