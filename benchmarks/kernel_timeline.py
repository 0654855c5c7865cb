"""The GPU's kernels in a torch.profiler trace, summarised one way for every benchmark that profiles a step
(gpu_train.py's --trace-steps, train_step_profile.py's --profile-steps).

A kernel is a CUDA event with a duration that is not a user annotation: the optimizer's step range and each
compiled graph's call ("Call CompiledFxGraph") are GPU-side annotations that span many kernels and the gaps between
them; counted as kernels they hide idle time and count work twice. Busy time is the union of the kernels' spans
(overlapping kernels on two streams count once), idle time the rest of the span from the first kernel's start to
the last one's end.
"""

from __future__ import annotations

from typing import NamedTuple

GEMM_KERNELS = ("gemm", "nvjet", "cutlass", "xmma", "magma", "cublas", "splitk")
ATTENTION_KERNELS = ("flash", "cudnn", "fmha", "flex", "attention")


class Kernel(NamedTuple):
    start_us: float
    end_us: float
    name: str


def kernel_kind(name: str) -> str:
    """gemm, attention, adamw, triton (elementwise, reductions) or other, from a kernel's name."""
    low = name.lower()
    if any(k in low for k in ATTENTION_KERNELS) or low.startswith("triton_tem"):  # flex attention: triton templates
        return "attention"
    if any(k in low for k in GEMM_KERNELS):
        return "gemm"
    if "adam" in low:
        return "adamw"
    if low.startswith("triton"):
        return "triton (elementwise, reductions)"
    return "other"


def device_kernels(events) -> list[Kernel]:
    """The kernels among a profile's events (`prof.events()`), by start time, user annotations left out."""
    import torch

    return sorted(Kernel(e.time_range.start, e.time_range.end, e.name) for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
                  and not getattr(e, "is_user_annotation", False) and not e.name.startswith("## "))


def timeline(kernels: list[Kernel], steps: int, top: int = 60) -> dict:
    """Per step over `steps` profiled steps: the span, busy and idle time, kernel count, kernel time by kind and
    by name (the `top` largest), and the idle gaps (all of them, longest first, as (ms, start_us, end_us))."""
    if not kernels:
        return {"error": "no CUDA kernels in the profile"}
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for s, e, name in kernels:
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + (e - s) / 1000
        by_name[name] = by_name.get(name, 0.0) + (e - s) / 1000
    busy, gaps = 0.0, []
    cur_s, cur_e = kernels[0].start_us, kernels[0].end_us
    for s, e, _ in kernels[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(((s - cur_e) / 1000, cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(k.end_us for k in kernels) - kernels[0].start_us
    gaps.sort(reverse=True)
    return {"steps": steps, "kernels_per_step": len(kernels) / steps, "gpu_span_ms": span / 1000,
            "gpu_busy_ms_per_step": busy / 1000 / steps, "gpu_idle_ms_per_step": (span - busy) / 1000 / steps,
            "kernel_ms_per_step": {k: round(v / steps, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms_per_step": {k[:90]: round(v / steps, 3)
                                        for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]},
            "gaps_under_20us": {"count": sum(1 for ms, _, _ in gaps if ms < 0.02),
                                "ms": sum(ms for ms, _, _ in gaps if ms < 0.02)},
            "gaps": gaps}
