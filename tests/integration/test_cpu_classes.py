"""The AVX2-only CPU class, on whatever x86 CPU runs the suite: ``ATEN_CPU_CAPABILITY=avx2`` and
``ONEDNN_MAX_CPU_ISA=AVX2`` make ATen and oneDNN run their AVX2 kernels, so BF16 is emulated and CPU-autocast BF16
``nn.LSTM`` raises oneDNN's primitive-descriptor error exactly as on an AVX2-only EPYC (on such a machine the
variables change nothing). The run itself is ``tests/scripts/cpu_class_run.py``, in a subprocess."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers.environment import inductor_cache_for_capability
from tests.helpers.paths import REPO, SCRIPTS

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                       reason="the AVX2 CPU class exists on x86 only"),
]


@pytest.fixture(scope="module")
def avx2_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("avx2") / "result.json"
    env = inductor_cache_for_capability(
        {**os.environ, **AVX2_ENV, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    done = subprocess.run([sys.executable, str(SCRIPTS / "cpu_class_run.py"), str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return dict(json.loads(out.read_text()))


def test_the_device_is_classified_as_avx2_without_native_16_bit(avx2_run: dict[str, Any]) -> None:
    cls = avx2_run["device_class"]
    assert avx2_run["capability"] == "AVX2" and cls["capability"] == "AVX2"
    assert cls["native"] == [] and cls["emulated"] == ["bf16", "fp16", "fp8", "fp8-rowwise"]


def test_an_explicit_plan_lowering_every_operator_family_trains_to_the_end(avx2_run: dict[str, Any]) -> None:
    explicit = avx2_run["explicit"]
    assert explicit["steps"] == 8 and explicit["finite"]  # 2 epochs of 4 batches, no crash inside oneDNN
    for name in ("lstm", "gru", "conv", "bn", "ln", "fc", "head"):
        assert explicit["precisions"][name] == "bf16", name
    # CPU autocast cannot run a bf16 LSTM here: it computes through bf16 parameter copies instead
    assert explicit["lowering"]["lstm"] == "params" and explicit["lowering"]["gru"] == "params"
    work = explicit["work_dtypes"]
    for name in ("lstm", "gru", "conv", "fc", "head"):  # the arithmetic runs in bf16 only
        assert work[name] == ["torch.bfloat16"], (name, work[name])
    for name in ("bn", "ln"):  # bf16 activations, fp32 statistics and affine parameters
        assert "torch.bfloat16" in work[name], (name, work[name])
    assert explicit["param_dtypes"] == ["torch.float32"] and explicit["grad_dtypes"] == ["torch.float32"]


def test_the_default_search_stays_fp32_at_no_cost(avx2_run: dict[str, Any]) -> None:
    search = avx2_run["search"]
    assert search["low_precision"] is None and search["trials"] == 0
    assert search["extension_epochs"] == 0 and search["epochs"] == 2
    # the report names the device class, the reason in its terms and the model's operators, and has no empty table
    why = search["finish_reason"]
    assert why.startswith("bf16 is emulated on this AVX2 CPU (") and "no AVX512-BF16 or AMX" in why, why
    slowdown = float(why.split("a matrix product runs ")[1].split("x slower")[0])
    assert slowdown > 3, why  # emulated: many times slower than fp32 (30-100x on the EPYCs seen)
    assert "trains in fp32 and searches nothing" in why and "fp16 " in why
    assert search["num_operators"] == search["model_operators"] > 0
    first = search["report"].splitlines()[0]
    assert first == f"CoMPSearch: chose 'fp32' ({why}): 0 of {search['num_operators']} operators in 16 bits", first
    assert "Convergence trials" not in search["report"] and "No convergence trials" in search["report"]
