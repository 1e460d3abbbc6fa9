#!/usr/bin/env bash
# The GPU check, for the day a CUDA GPU is lent: everything only a GPU can show, into one results folder.
#
#   bash benchmarks/gpu_check.sh [OUT]        (default: benchmarks/results/gpu_check)
#
# 1. tests/cuda/ (the package on the GPU through a real Trainer: planned dtypes on CUDA kernels, the search with
#    CUDA timing, fp16 loss scaling, a checkpoint resumed on the GPU, the benchmark, a memory search with a budget in
#    bytes judged by the caching allocator's reserved peak);
# 2. the CUDA simulation's checks against the real device (python -m tests.cuda_sim.run --real): what CI checks on a
#    simulated GPU every run, now with real kernels (cuDNN RNNs, fused attention, real host syncs);
# 3. a short benchmarks/compare.py run on CUDA (FP32, AMP, bf16-true, CoMP side by side);
# 4. benchmarks/fp8_check.py: per-Linear fp8/bf16 time over a range of shapes, and a short CoMPSearch(fp8="auto") of a
#    ~100M CharGPT trained beside bf16-mixed and torchao's float8 on every Linear and with its automatic filter.
# Each step has its own time limit; all together fit in 9.5 minutes on one H100/H200. Exit status: 0 when every step
# passed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu_check}
mkdir -p "$out"
status=0

python - > "$out/device.txt" 2>&1 <<'PY'
import platform, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, python {platform.python_version()}")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible to torch: the GPU check needs a CUDA build of torch and a GPU")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} sm{p.major}{p.minor} {p.total_memory / 2**30:.0f} GiB")
PY
if [ $? -ne 0 ]; then cat "$out/device.txt"; exit 2; fi
cat "$out/device.txt"

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - started)) s (limit $limit s)" | tee -a "$out/steps.txt"
  [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1
}

step tests_cuda 200 python -m pytest tests/cuda -m cuda -q -p no:cacheprovider --junitxml "$out/tests_cuda.xml"
step cuda_checks_real 80 python -m tests.cuda_sim.run --real -q --junitxml "$out/cuda_checks_real.xml"
step compare 120 python benchmarks/compare.py --models gpt,cnn,lstm --modes fp32,bf16-mixed,bf16-true,comp \
  --steps-scale 0.25 --no-plots --no-profile --timeout 100 --out "$out/compare"
step fp8 170 python benchmarks/fp8_check.py --out "$out/fp8" --steps 40 --warmup 8 --rounds 8 --search-batches 20 \
  --trial-batches 8 --max-trials 2

python - "$out" > "$out/summary.md" 2>&1 <<'PY'
import sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
print("# GPU check\n")
print((out / "device.txt").read_text())
print((out / "steps.txt").read_text())
for name in ("tests_cuda", "cuda_checks_real"):
    path = out / f"{name}.xml"
    if not path.exists():
        print(f"{name}: no report"); continue
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    print(f"{name}: {suite.get('tests')} tests, {suite.get('failures')} failures, {suite.get('errors')} errors,"
          f" {suite.get('skipped')} skipped")
    for case in suite.iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            print(f"  FAILED {case.get('name')}: {(bad.get('message') or '')[:300]}")
for table in (out / "compare" / "compare.md", out / "fp8" / "fp8_check.md"):
    if table.exists():
        print("\n" + table.read_text())
PY
cat "$out/summary.md"
exit $status
