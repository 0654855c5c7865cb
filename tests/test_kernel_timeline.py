"""benchmarks/kernel_timeline.py: the GPU profile summary of gpu_train.py and train_step_profile.py, on kernel
timelines written by hand (the CPU has no CUDA events to profile)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from kernel_timeline import Kernel, kernel_kind, timeline  # noqa: E402


def test_busy_time_counts_overlapping_kernels_once_and_idle_time_is_the_rest_of_the_span():
    kernels = [Kernel(0, 100, "nvjet_tst_128x256_64x4"),          # a GEMM
               Kernel(50, 150, "triton_poi_fused_add_0"),          # overlaps it on another stream
               Kernel(160, 170, "triton_red_fused_sum_1"),         # a 10 us gap before it
               Kernel(1170, 1270, "cudnn_generated_fort_native_sdpa"),  # a 1 ms gap before it
               Kernel(1200, 1210, "triton_tem_fused_flex_2")]      # inside the attention kernel's span
    t = timeline(kernels, steps=2)
    assert t["gpu_span_ms"] == pytest.approx(1.27)
    assert t["gpu_busy_ms_per_step"] == pytest.approx((150 + 10 + 100) / 1000 / 2)
    assert t["gpu_idle_ms_per_step"] == pytest.approx((10 + 1000) / 1000 / 2)
    assert [g[0] for g in t["gaps"]] == pytest.approx([1.0, 0.01])
    assert t["gaps_under_20us"] == {"count": 1, "ms": pytest.approx(0.01)}
    assert t["kernels_per_step"] == 2.5
    assert t["kernel_ms_per_step"] == pytest.approx({"gemm": 0.05, "triton (elementwise, reductions)": 0.055,
                                                     "attention": 0.055}, abs=0.005)  # rounded to 0.01 ms
    assert list(t["top_kernels_ms_per_step"])[0] == "nvjet_tst_128x256_64x4"


def test_kernel_kinds_by_name():
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kernel_kind("triton_tem_fused_0") == "attention"  # flex attention's template kernels
    assert kernel_kind("multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "adamw"
    assert kernel_kind("triton_per_fused__to_copy_mul_sum_3") == "triton (elementwise, reductions)"
    assert kernel_kind("Memcpy DtoD (Device -> Device)") == "other"


def test_an_empty_profile_is_reported_not_raised():
    assert timeline([], steps=1) == {"error": "no CUDA kernels in the profile"}
