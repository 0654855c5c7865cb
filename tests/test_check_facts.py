"""`draftsmith check` against the engine facts table (src/draftsmith/data/rules/engine_facts.json).

The table is read out of released wheels by scripts/engine_facts.py; these tests hold the rules to it and
pin a few facts that the releases themselves show (whitelists, model tables, the per-model aux-id shift).
CI never downloads wheels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.version import Version

from draftsmith.preflight import check
from draftsmith.preflight.check import CheckSettings
from draftsmith.errors import DraftsmithError

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
TARGETS, DRAFTERS = FIXTURES / "targets", FIXTURES / "drafters"
VLLM_KEYS = {"eagle3_whitelist", "eagle3_modules", "eagle3_archs", "aux_ids_read", "method_path_guess", "norm_flags_read",
             "draft_max_position_override", "tp_key_rejected", "multimodal_probes", "mla_drafter", "sources",
             "arch_modules", "transformers_backend_eagle3", "speculators_types", "mla_drafter_model_types",
             "multimodal_probe_map", "eagle3_arch_naming", "d2t_full_vocab_unloadable", "kv_mixed_page_groups",
             "mrope_propose_reads_positions", "cli_flags", "aux_forced_runners", "mrv2_default", "fc_aux_count",
             "draft_layer_kv_config", "layer_types_unshifted"}
SGLANG_KEYS = {"eagle3_modules", "eagle3_archs", "arch_modules", "draft_archs", "aux_shift", "aux_ids_read", "norm_flags_read",
               "mla_drafter", "capture_error", "draft_context", "draft_context_rope_raised", "sm100_trtllm_mla_archs",
               "pp_spec_algorithms", "embed_head_archs", "spec_v2_topk", "cli_flags", "aux_unpacked_twice",
               "capture_ignored_archs"}


def write(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def llama_drafter(tmp_path, **over) -> Path:
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
              "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "draft_vocab_size": 32000, "max_position_embeddings": 131072} | over
    return write(tmp_path / "drafter-eagle3", config)


def run(target, drafter, engine="vllm", version="0.33.0", spec=None, engine_args=""):
    return check.run_checks(Path(target), Path(drafter),
        CheckSettings(engine=engine, engine_version=version, speculative_config=json.dumps(spec) if spec else None,
                      engine_args=engine_args))


def errors(findings, kind=None) -> list[str]:
    return [f.rule for f in findings if f.severity == "error" and (kind is None or f.kind == kind)]


# ---------------------------------------------------------------- the table itself

@pytest.mark.parametrize("engine, keys, oldest, at_least", [
    ("vllm", VLLM_KEYS, "0.8.0", 40), ("sglang", SGLANG_KEYS, "0.4.0", 90)])
def test_the_table_covers_every_release_read_with_every_fact(engine, keys, oldest, at_least):
    rows = check.facts_table()[engine]
    assert len(rows) >= at_least
    assert min(rows, key=Version).startswith(oldest)
    for version, facts in rows.items():
        assert keys <= set(facts), (version, keys - set(facts))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_version_assumed_without_one_is_the_newest_release_read(engine):
    """docs/check.md: with no version given, the newest version the rules know is assumed."""
    assert check.load_rules(engine).default_version == max(check.facts_table()[engine], key=Version)


def test_every_fact_a_rule_names_is_computed(tmp_path):
    """A rule that names a fact nobody computes would never fire: hold every rule against the facts."""
    for engine in ("vllm", "sglang"):
        _, facts = run(TARGETS / "llama-3.1-8b", llama_drafter(tmp_path / engine), engine=engine,
                       version=check.load_rules(engine).default_version)
        for rule in check.load_rules(engine).rules:
            assert check.referenced_facts(rule) <= set(facts), (rule.id, check.referenced_facts(rule) - set(facts))


@pytest.mark.parametrize("version, whitelist", [
    ("0.8.5", ["llama"]), ("0.10.0", ["llama"]), ("0.10.1.1", ["llama", "qwen"]),
    ("0.11.0", ["llama", "qwen", "minicpm", "gpt_oss"]), ("0.17.0", None), ("0.33.0", None)])
def test_the_whitelist_per_release_is_the_one_the_wheel_holds(version, whitelist):
    assert check.engine_release("vllm", version).facts["eagle3_whitelist"] == whitelist


def test_a_post_release_and_an_unlisted_patch_use_the_release_they_belong_to():
    """SGLang is read per post release (model files change in them); an unlisted patch uses the newest release at
    or below it."""
    assert check.engine_release("sglang", "0.5.6").read == "0.5.6"
    assert check.engine_release("sglang", "0.5.5.post2").read == "0.5.5.post2"
    assert check.engine_release("sglang", "0.5.5.post9").read == "0.5.5.post3"
    assert check.engine_release("vllm", "0.9.0.1").read == "0.9.0.1"
    assert check.engine_release("vllm", "0.13.1").read == "0.13.0"
    assert check.engine_release("vllm", "0.10.1").read == "0.10.1"  # not its later patch 0.10.1.1


def test_newer_than_the_table_says_so_and_uses_the_newest_release(tmp_path):
    newest = max(check.facts_table()["vllm"], key=Version)
    findings, facts = run(TARGETS / "llama-3.1-8b", llama_drafter(tmp_path), version="9.0.0")
    note = next(f for f in findings if f.rule == "check.version-newer-than-table")
    assert note.severity == "warning" and newest in note.message and "9.0.0" in note.message
    assert facts["facts_release"] == newest


def test_older_than_the_table_says_target_support_was_not_checked(tmp_path):
    findings, facts = run(TARGETS / "qwen3-8b", llama_drafter(tmp_path, vocab_size=151936), version="0.7.3")
    assert "check.version-older-than-table" in {f.rule for f in findings}
    assert facts["target_supports_eagle3"] is None


# ---------------------------------------------------------------- rules read from the table

def test_support_is_decided_per_class_with_inheritance_resolved(tmp_path):
    """A class inheriting the hooks counts (vLLM's Qwen3-VL-MoE from Qwen3-VL); an SGLang wrapper whose class
    lacks set_eagle3_layers_to_capture does not (sglang#17935, Qwen3-VL-30B-A3B on 0.5.7), whatever its file."""
    assert "Qwen3VLMoeForConditionalGeneration" in check.engine_release("vllm", "0.13.0").facts["eagle3_archs"]
    assert "MistralForCausalLM" in check.engine_release("vllm", "0.13.0").facts["eagle3_archs"]
    target = write(tmp_path / "qwen3-vl-moe", {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe", "image_token_id": 1,
        "vision_config": {"depth": 27}, "text_config": {"model_type": "qwen3_vl_moe_text", "hidden_size": 2048,
                                                        "num_hidden_layers": 48, "num_attention_heads": 32,
                                                        "vocab_size": 151936}})
    drafter = llama_drafter(tmp_path, hidden_size=2048, vocab_size=151936)
    findings, facts = run(target, drafter, engine="sglang", version="0.5.7")
    assert facts["target_module"] and facts["target_supports_eagle3"] is False
    assert "sglang.layer-capture" in errors(findings, "start")


def test_entry_classes_are_read_per_name_not_across_lines():
    """`EntryClass = Gemma3ForCausalLM` followed by `AutoModel = ...` registers Gemma3ForCausalLM (the table once
    keyed it 'Gemma3ForCausalLM\\nAutoModel', so SGLang's Gemma 3 and Qwen3-Next targets were 'unknown')."""
    modules = check.engine_release("sglang", "0.5.23").facts["arch_modules"]
    assert modules["Gemma3ForCausalLM"] == "gemma3_causal" and modules["Qwen3NextForCausalLM"] == "qwen3_next"
    assert not [name for name in modules if not name.isidentifier()]


def test_sglang_targets_without_get_embed_and_head_cannot_start_an_eagle_worker(tmp_path):
    """The EAGLE draft worker calls get_embed_and_head() on the target right after loading the drafter (EAGLE and
    EAGLE3): MiniMax-M2 lacked it until 0.5.5.post3 (sglang#13297), Qwen3-VL-MoE lacks it (sglang#17935)."""
    target = write(tmp_path / "minimax-m2", {
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "hidden_size": 3072,
        "num_hidden_layers": 62, "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 200064, "max_position_embeddings": 196608})
    drafter = llama_drafter(tmp_path, hidden_size=3072, num_attention_heads=48, vocab_size=200064,
                            max_position_embeddings=196608)
    findings, facts = run(target, drafter, engine="sglang", version="0.5.5.post2")
    assert facts["target_has_embed_head"] is False
    rule = next(f for f in findings if f.rule == "sglang.embed-and-head")
    assert (rule.severity, rule.kind) == ("error", "start") and "0.5.5.post3" in rule.fix
    findings, facts = run(target, drafter, engine="sglang", version="0.5.5.post3")
    assert facts["target_has_embed_head"] is True and "sglang.embed-and-head" not in errors(findings)
    eagle = "--speculative-algorithm EAGLE --speculative-draft-model-path D"
    findings, _ = run(target, drafter, engine="sglang", version="0.5.5.post2", engine_args=eagle)
    assert errors(findings)[0] == "sglang.embed-and-head"  # a start error outranks EAGLE's silent accept collapse


def test_explicit_aux_ids_are_ignored_by_releases_that_do_not_read_them(tmp_path):
    """vLLM read explicit aux ids only after vllm#25961; before, the runner always set the default."""
    drafter = llama_drafter(tmp_path, eagle_aux_hidden_state_layer_ids=[1, 15, 28])
    _, old = run(TARGETS / "llama-3.1-8b", drafter, version="0.10.0")
    _, new = run(TARGETS / "llama-3.1-8b", drafter, version="0.33.0")
    assert old["engine_reads_explicit_aux"] is False and old["aux_engine_reads"] == [2, 16, 29]
    assert new["aux_engine_reads"] == [1, 15, 28]


@pytest.mark.parametrize("ids, version, reads", [
    ([12, 18, 24], "0.5.23", [12, 18, 24]),   # gpt_oss (24 layers) keeps ids that reach the last boundary
    ([1, 11, 20], "0.5.23", [2, 12, 21]),     # otherwise the +1
])
def test_sglang_shifts_aux_ids_the_way_the_target_model_file_does(tmp_path, ids, version, reads):
    drafter = write(tmp_path / "gpt-oss-eagle3", {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 2880, "vocab_size": 201088,
        "num_attention_heads": 64, "max_position_embeddings": 131072, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}})
    _, facts = run(TARGETS / "gpt-oss-20b", drafter, engine="sglang", version=version)
    assert facts["aux_engine_reads"] == reads


def test_sglang_deepseek_wrapper_follows_its_language_model_file(tmp_path):
    """Kimi-K2.5's model file delegates to DeepSeek-V2's, which adds 1 only when the first id is 1."""
    for ids, reads in (([1, 29, 57], [2, 30, 58]), ([2, 30, 58], [2, 30, 58])):
        d = json.loads((DRAFTERS / "kimi-k25-eagle3-specforge" / "config.json").read_text())
        d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        _, facts = run(TARGETS / "kimi-k2.5", write(tmp_path / f"d{ids[0]}", d), engine="sglang", version="0.5.23")
        assert facts["aux_engine_reads"] == reads


def test_rope_cache_shorter_than_the_context_is_a_serve_warning_where_the_release_keeps_it(tmp_path):
    drafter = llama_drafter(tmp_path, max_position_embeddings=2048)
    keeps = next(v for v, f in sorted(check.facts_table()["vllm"].items(), key=lambda kv: Version(kv[0]))
                 if Version(v) >= Version("0.18.0") and not f["draft_max_position_override"])
    findings, _ = run(TARGETS / "llama-3.1-8b", drafter, version=keeps)
    rope = next(f for f in findings if f.rule == "vllm.max-position")
    assert (rope.severity, rope.kind) == ("warning", "serve") and "vllm.max-position" not in errors(findings)
    raised = next(v for v, f in check.facts_table()["vllm"].items() if f["draft_max_position_override"])
    findings, _ = run(TARGETS / "llama-3.1-8b", drafter, version=raised)
    assert "vllm.max-position" not in errors(findings)
    assert "vllm.max-position-raised" in {f.rule for f in findings if f.severity == "warning"}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_other_tokenizer_with_equal_hidden_size_accepts_nothing(tmp_path, engine):
    findings, _ = run(TARGETS / "llama-3.1-8b", llama_drafter(tmp_path, vocab_size=151936, draft_vocab_size=32000),
                      engine=engine, version=check.load_rules(engine).default_version)
    assert f"{engine}.vocab" in errors(findings, "accept")


def test_tensor_parallel_that_does_not_divide_the_heads_will_not_start(tmp_path):
    drafter = llama_drafter(tmp_path)
    findings, _ = run(TARGETS / "llama-3.1-8b", drafter, engine_args="--tensor-parallel-size 3")
    assert {"vllm.tp-heads", "vllm.draft-tp-heads"} <= set(errors(findings, "start"))
    findings, _ = run(TARGETS / "llama-3.1-8b", drafter, engine_args="-tp 3",
                      spec={"method": "eagle3", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1})
    assert "vllm.draft-tp-heads" not in errors(findings)


def test_the_first_start_error_is_the_first_the_engine_meets(tmp_path):
    """DeepSeek-V3 on vLLM 0.17.0 with TP 7: the config check (heads) fires seconds in, before the weights load
    and long before the SupportsEagle3 check; that one comes "after fixing" the first."""
    drafter = write(tmp_path / "ds-eagle3", {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                                             "hidden_size": 7168, "vocab_size": 129280, "num_attention_heads": 56,
                                             "max_position_embeddings": 163840})
    findings, _ = run(TARGETS / "deepseek-v3", drafter, version="0.17.0", engine_args="-tp 3")  # vLLM has no --tp
    starts = [f for f in findings if f.severity == "error" and f.kind == "start"]
    assert starts[0].rule == "vllm.tp-heads"
    assert all(f.message.startswith("after fixing vllm.tp-heads") for f in starts[1:])
    assert "vllm.eagle3-interface" in {f.rule for f in starts[1:]}


# ---------------------------------------------------------------- configs read the way the engine reads them

def test_fields_a_published_config_omits_take_their_transformers_defaults(tmp_path):
    """A Llama config without max_position_embeddings / rope_theta / tie_word_embeddings: LlamaConfig's defaults."""
    config = json.loads((TARGETS / "llama-3.1-8b" / "config.json").read_text())
    for key in ("max_position_embeddings", "num_key_value_heads", "tie_word_embeddings", "rope_theta"):
        config.pop(key, None)
    _, facts = run(write(tmp_path / "t", config), llama_drafter(tmp_path))
    assert facts["target_max_position"] == 2048  # LlamaConfig default
    assert facts["target_num_kv_heads"] == facts["target_num_heads"]


def test_derived_fields_are_derived_from_this_config_not_from_the_class_default(tmp_path):
    """LlamaConfig derives KV heads and head_dim from the config's own heads and hidden size (576 / 9 -> 64)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
              "num_hidden_layers": 30, "num_attention_heads": 9, "vocab_size": 49152}
    drafter = llama_drafter(tmp_path, hidden_size=576, vocab_size=49152, num_attention_heads=9)
    _, facts = run(write(tmp_path / "smol", config), drafter)
    assert facts["target_num_kv_heads"] == 9 and facts["target_max_position"] == 2048


def test_a_multimodal_wrapper_with_a_sparse_text_config_is_unwrapped_with_its_class_defaults(tmp_path):
    config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
              "image_token_id": 151655, "vision_config": {"depth": 32},
              "text_config": {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                              "num_key_value_heads": 4}}
    _, facts = run(write(tmp_path / "vl", config), llama_drafter(tmp_path, hidden_size=3584, vocab_size=152064))
    assert facts["target_hidden_size"] == 3584 and facts["target_vocab_size"] == 152064  # Qwen2_5_VL text default


# Qwen3-Omni keeps its language model's config one level deeper than a VL wrapper: in the thinker
# (`thinker_config.text_config`), which is what both engines serve. Widths are small made-up values.
QWEN3_OMNI = {"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
              "thinker_config": {"model_type": "qwen3_omni_moe_thinker", "image_token_id": 151655,
                                 "vision_config": {"depth": 2},
                                 "text_config": {"model_type": "qwen3_omni_moe_text", "hidden_size": 512,
                                                 "num_hidden_layers": 8, "num_attention_heads": 8,
                                                 "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 152064}},
              "talker_config": {"model_type": "qwen3_omni_moe_talker"}}


@pytest.mark.parametrize("version, supported", [("0.28.0", False), ("0.29.0", True)])
def test_an_omni_wrapper_is_read_through_its_thinker_text_config(tmp_path, version, supported):
    drafter = llama_drafter(tmp_path, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                            vocab_size=152064)
    findings, facts = run(write(tmp_path / "omni", QWEN3_OMNI), drafter, version=version)
    assert facts["target_hidden_size"] == 512 and facts["target_num_layers"] == 8
    assert facts["target_vocab_size"] == 152064 and facts["target_has_vision"]
    assert ("vllm.eagle3-interface" in errors(findings)) is not supported


@pytest.mark.parametrize("thinker_fields, version, probe_error", [
    ({"image_token_id": 151655}, "0.29.0", True),   # the thinker config vLLM's model holds lacks image_token_index
    ({"image_token_index": 151655}, "0.29.0", False),
    ({"image_token_id": 151655}, "0.34.0", False)])  # 0.34.0's drafter loader copies no image token
def test_an_omni_target_is_probed_on_the_thinker_config_its_model_class_holds(tmp_path, thinker_fields, version,
                                                                              probe_error):
    thinker = {k: v for k, v in QWEN3_OMNI["thinker_config"].items() if k != "image_token_id"} | thinker_fields
    drafter = llama_drafter(tmp_path, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                            vocab_size=152064)
    findings, _ = run(write(tmp_path / "omni", QWEN3_OMNI | {"thinker_config": thinker}), drafter, version=version)
    assert ("vllm.multimodal-probe" in errors(findings)) is probe_error


def test_a_config_that_is_not_json_is_a_clear_error(tmp_path):
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\n")
    with pytest.raises(DraftsmithError) as err:
        run(target, llama_drafter(tmp_path))
    assert "not JSON" in str(err.value) and "config.json" in str(err.value)
    (target / "config.json").write_text("[1, 2]")
    with pytest.raises(DraftsmithError, match="not a JSON object"):
        run(target, llama_drafter(tmp_path / "2"))


QWEN3_4B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728,
            "vocab_size": 151936, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_drafter_without_head_dim_on_a_target_whose_head_dim_differs_is_a_start_warning(tmp_path, engine):
    """Qwen3-4B: 2560 / 32 = 80, the target uses 128 (AngelSlim Qwen3-4B fails to load, Qwen3-32B loads)."""
    target = write(tmp_path / "qwen3-4b", QWEN3_4B)
    version = check.load_rules(engine).default_version
    shape = {"hidden_size": 2560, "num_attention_heads": 32, "vocab_size": 151936}
    findings, facts = run(target, llama_drafter(tmp_path / "a", **shape), engine=engine, version=version)
    hint = next(f for f in findings if f.rule == f"{engine}.drafter-head-dim-unset")
    assert (hint.severity, hint.kind) == ("warning", "start") and "80" in hint.message and "128" in hint.message
    findings, _ = run(target, llama_drafter(tmp_path / "b", head_dim=128, **shape), engine=engine, version=version)
    assert f"{engine}.drafter-head-dim-unset" not in {f.rule for f in findings}
    target8b = write(tmp_path / "qwen3-8b", QWEN3_4B | {"hidden_size": 4096})  # 4096 / 32 = 128: nothing to guess
    findings, _ = run(target8b, llama_drafter(tmp_path / "c", hidden_size=4096, vocab_size=151936), engine=engine,
                      version=version)
    assert f"{engine}.drafter-head-dim-unset" not in {f.rule for f in findings}


# ---------------------------------------------------------------- model tables from the registries

def test_the_target_module_comes_from_the_release_registry_with_the_transformers_fallback(tmp_path):
    """vLLM 0.9.2 registers no Kimi-K2.5 class: it would run on the Transformers backend, which implements no
    EAGLE-3 hooks there; 0.15.0 registers kimi_k25. The map is the wheel's registry.py, not a hand-typed table."""
    drafter = DRAFTERS / "kimi-k25-eagle3-specforge"
    _, old = run(TARGETS / "kimi-k2.5", drafter, version="0.9.2")
    assert (old["target_module"], old["target_supports_eagle3"]) == ("transformers", False)
    _, new = run(TARGETS / "kimi-k2.5", drafter, version="0.15.0")
    assert new["target_module"] == "kimi_k25"
    rows = check.facts_table()["vllm"]
    assert rows["0.9.2"]["transformers_backend_eagle3"] is False and rows["0.15.0"]["transformers_backend_eagle3"]
    assert check.facts_table()["sglang"]["0.5.23"]["arch_modules"]["Gemma3ForCausalLM"] == "gemma3_causal"


# ---------------------------------------------------------------- the GPU as an input

@pytest.mark.parametrize("gpu, sm", [("H200", 9), ("B200", 10), ("GB300", 10), ("sm100", 10), ("sm_90", 9),
                                     ("12.0", 12), ("NVIDIA RTX PRO 6000", 12)])
def test_a_gpu_is_read_as_its_compute_capability(gpu, sm):
    assert check.gpu_compute_capability(gpu)[0] == sm


def test_an_unknown_gpu_names_the_forms_it_takes():
    with pytest.raises(DraftsmithError, match="sm100"):
        check.gpu_compute_capability("TPUv5")


KIMI_MHA = DRAFTERS / "kimi-k25-eagle3-specforge"
SG_ARGS = "--speculative-algorithm EAGLE3 --speculative-draft-model-path D --tp 8"


@pytest.mark.parametrize("gpu, extra, rule", [
    ("B200", "", "error"),                                              # SM100: trtllm_mla by default, inherited
    ("H200", "", None),                                                 # Hopper: another default
    (None, "", "warning"),                                              # which GPU, check was not told
    ("B200", " --speculative-draft-attention-backend trtllm_mha", None),  # sgl-project/sglang#23490's workaround
    ("H200", " --attention-backend trtllm_mla", "error"),               # named outright
])
def test_an_mha_drafter_inheriting_sglangs_mla_backend_will_not_start(tmp_path, gpu, extra, rule):
    """Kimi-K2.5 with the SpecForge MHA head on SGLang 0.5.10.post1 (sgl-project/sglang#23490)."""
    findings, _ = check.run_checks(TARGETS / "kimi-k2.5", KIMI_MHA,
        CheckSettings(engine="sglang", engine_version="0.5.10.post1", engine_args=SG_ARGS + extra, gpu=gpu))
    got = {f.rule: f for f in findings if f.rule.startswith("sglang.draft-attention")}
    if rule == "error":
        assert "sglang.draft-attention-mla-backend" in errors(findings, "start")
    elif rule == "warning":
        assert got["sglang.draft-attention-gpu"].severity == "warning" and not errors(findings, "start")
    else:
        assert not got


def test_the_mla_default_follows_the_release_list_and_spares_mla_drafters(tmp_path):
    """DeepSeek-V3 is on the SM100 trtllm_mla list from 0.5.3.post2 (the table's first release with it, read per post release); an MLA
    drafter runs on that backend."""
    drafter = write(tmp_path / "ds-eagle3", {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                                             "hidden_size": 7168, "vocab_size": 129280, "num_attention_heads": 56,
                                             "max_position_embeddings": 163840})
    first = min((v for v, f in check.facts_table()["sglang"].items() if f["sm100_trtllm_mla_archs"]), key=Version)
    assert first == "0.5.3.post2"
    for version, fires in (("0.5.2", False), (first, True)):
        findings, _ = check.run_checks(TARGETS / "deepseek-v3", drafter,
            CheckSettings(engine="sglang", engine_version=version, engine_args=SG_ARGS, gpu="B200"))
        assert ("sglang.draft-attention-mla-backend" in errors(findings)) is fires, version
    findings, _ = check.run_checks(TARGETS / "kimi-k2.5", DRAFTERS / "kimi-k25-eagle3-mla",
        CheckSettings(engine="sglang", engine_version="0.5.23", engine_args=SG_ARGS, gpu="B200"))
    assert "sglang.draft-attention-mla-backend" not in errors(findings)


# ---------------------------------------------------------------- SGLang's draft context length

def test_sglang_derives_context_lengths_its_own_way():
    """hf_transformers_utils.get_context_length: rope factor only without original_max_position_embeddings / llama3."""
    llama = json.loads((TARGETS / "llama-3.1-8b" / "config.json").read_text())
    kimi = json.loads((TARGETS / "kimi-k2.5" / "config.json").read_text())["text_config"]
    assert check.sglang_context_length(llama) == 131072 and check.sglang_context_length(kimi) == 262144
    assert check.sglang_context_length({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear",
                                                                                         "factor": 4.0}}) == 16384
    assert check.sglang_context_length({}) == 2048


@pytest.mark.parametrize("version, env, rule, severity, kind", [
    ("0.5.9", "", "sglang.draft-context", "warning", "start"),            # raises unless the variable is set
    ("0.5.9", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=0 ", "sglang.draft-context-env", "error", "start"),
    ("0.5.9", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 ", "sglang.draft-context-raised", "warning", "accept"),
    ("0.4.9.post6", "", "sglang.draft-context-extended", "warning", "serve"),  # the variable defaulted to true
])
def test_a_drafter_with_a_shorter_context_than_the_target_on_sglang(version, env, rule, severity, kind):
    """The original 2,048-position Llama-3.1 EAGLE-3 head: the draft worker gets the target's 131,072."""
    findings, facts = check.run_checks(TARGETS / "llama-3.1-8b", DRAFTERS / "eagle3-llama3.1-8b-original",
        CheckSettings(engine="sglang", engine_version=version,
                      engine_args=env + "--speculative-algorithm EAGLE3 --speculative-draft-model-path D"))
    got = next(f for f in findings if f.rule == rule)
    assert (got.severity, got.kind) == (severity, kind)
    assert facts["drafter_context_sglang"] == 2048 and facts["sg_served_context"] == 131072
    findings, _ = check.run_checks(TARGETS / "llama-3.1-8b", DRAFTERS / "eagle3-llama3.1-8b-original",
        CheckSettings(engine="sglang", engine_version=version,
                      engine_args=env + "--speculative-algorithm EAGLE3 --context-length 2048"))
    assert not [f for f in findings if f.rule.startswith("sglang.draft-context")]


def test_engine_args_read_single_dash_flags_negative_numbers_and_lists():
    """A single-dash flag after a switch starts a flag of its own (vllm#22872's '--trust-remote-code -tp 1' was
    once read as trust_remote_code='-tp' and then refused); '-1' is a value; SGLang's list flags keep every value."""
    args = check.parse_engine_args("--trust-remote-code -tp 2 --chunked-prefill-size -1 --cuda-graph-bs 32 40")
    assert args == {"trust_remote_code": "true", "tensor_parallel_size": "2", "chunked_prefill_size": "-1",
                    "cuda_graph_bs": "32 40"}
    with pytest.raises(DraftsmithError):
        check.parse_engine_args("tp 2")


@pytest.mark.parametrize("engine, version, text, key, value", [
    ("sglang", "0.5.11", "--speculative-algo EAGLE --tp 8", "speculative_algorithm", "EAGLE"),  # sglang#25673's line
    ("sglang", "0.5.11", "--speculative-algo EAGLE --tp 8", "tensor_parallel_size", "8"),  # a prefix of --tp-size
    ("sglang", "0.5.9", "--speculative-draft-model D", "speculative_draft_model_path", "D"),  # an alias
    ("sglang", "0.5.9", "--mem-fraction 0.6 --context-len 4096", "context_length", "4096"),
    ("vllm", "0.11.0", "--tensor-parallel 2 --max-model-len 65536", "tensor_parallel_size", "2"),  # vllm#26328's line
    ("vllm", "0.33.0", "-sc {}", "speculative_config", "{}"),  # -sc names --speculative-config from 0.33.0 on
])
def test_engine_args_are_read_the_way_the_release_parses_them(engine, version, text, key, value):
    """Both engines parse with argparse's allow_abbrev: an unambiguous prefix of a long option, or another option
    string of the same add_argument call, is that flag (facts cli_flags, read from each release's parser)."""
    assert check.parse_engine_args(text, check.engine_release(engine, version).facts["cli_flags"])[key] == value


def test_an_ambiguous_prefix_names_no_flag():
    """`--speculative-draft` starts --speculative-draft-model-path, -revision, -attention-backend, ...: argparse
    refuses it, and check does not guess which one was meant."""
    flags = check.engine_release("sglang", "0.5.9").facts["cli_flags"]
    assert check.parse_engine_args("--speculative-draft D", flags) == {"speculative_draft": "D"}


def test_an_abbreviated_algorithm_flag_is_the_algorithm(tmp_path):
    """`--speculative-algo EAGLE` with an EAGLE-3 head (sglang#25673, #21272) is EAGLE run on an EAGLE-3 drafter,
    not a server without speculation."""
    drafter = write(tmp_path / "drafter-eagle3", json.loads((DRAFTERS / "kimi-k25-eagle3-specforge" / "config.json")
                                                            .read_text()))
    findings, facts = check.run_checks(TARGETS / "kimi-k2.5", drafter,
        CheckSettings(engine="sglang", engine_version="0.5.11",
                      engine_args="--speculative-algo EAGLE --speculative-draft-model-path D --tp 8"))
    assert facts["sg_algorithm"] == "EAGLE"
    assert "sglang.algorithm" in errors(findings, "accept") and "sglang.algorithm-missing" not in errors(findings)


def test_environment_assignments_in_engine_args_are_the_servers_environment():
    text = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 --tp 8 --context-length=4096"
    assert check.parse_engine_env(text) == {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    assert check.parse_engine_args(text) == {"tensor_parallel_size": "8", "context_length": "4096"}


@pytest.mark.parametrize("version, algorithm, refused", [
    ("0.5.9", "EAGLE3", True), ("0.5.23", "EAGLE3", True), ("0.5.23", "EAGLE", False), ("0.4.0.post2", "EAGLE3", None)])
def test_sglang_pipeline_parallelism_with_speculative_decoding(tmp_path, version, algorithm, refused):
    """server-args validation refuses --pp-size > 1 with speculation (from 0.4.6); 0.5.21 on allows EAGLE alone."""
    drafter = llama_drafter(tmp_path, vocab_size=151936, max_position_embeddings=40960)  # the Qwen3-8B drafter shape
    args = f"--speculative-algorithm {algorithm} --speculative-draft-model-path D --pp-size 2"
    findings, facts = check.run_checks(TARGETS / "qwen3-8b", drafter,
        CheckSettings(engine="sglang", engine_version=version, engine_args=args))
    assert facts["sg_pp_refuses_algorithm"] is refused
    assert ("sglang.pipeline-parallel" in errors(findings, "start")) is bool(refused)
    _, facts = check.run_checks(TARGETS / "qwen3-8b", drafter,
        CheckSettings(engine="sglang", engine_version=version, engine_args=args.replace("--pp-size", "--tp")))
    assert not facts["sg_pp_refuses_algorithm"]


def test_a_speculators_drafter_needs_a_vllm_that_reads_the_format():
    """vLLM reads speculators configs (RedHatAI's EAGLE-3 releases) from 0.10.1 (transformers_utils/configs/speculators)."""
    drafter = DRAFTERS / "llama3.1-8b-speculators-eagle3"
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    for version, fires in (("0.10.0", True), ("0.10.1", False), ("0.33.0", False)):
        findings, _ = run(TARGETS / "llama-3.1-8b", drafter, version=version, spec=spec)
        assert ("vllm.speculators-format" in errors(findings, "start")) is fires, version


def test_an_mla_drafter_typed_kimi_k2_is_sized_as_mla_only_where_the_release_counts_it(tmp_path):
    """is_deepseek_mla()'s branch for EAGLE heads lists DeepSeek model types, not kimi_k2, in every release read
    (0.18.0-0.33.0); retyping the drafter deepseek_v3 settles it."""
    config = json.loads((DRAFTERS / "kimi-k25-eagle3-mla" / "config.json").read_text())
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    for version in ("0.18.0", "0.33.0"):
        assert "kimi_k2" not in check.engine_release("vllm", version).facts["mla_drafter_model_types"]
        findings, _ = run(TARGETS / "kimi-k2.5", write(tmp_path / f"k{version}", config), version=version, spec=spec)
        assert "vllm.mla-drafter-model-type" in {f.rule for f in findings if f.severity == "warning"}
        findings, _ = run(TARGETS / "kimi-k2.5", write(tmp_path / f"d{version}", config | {"model_type": "deepseek_v3"}),
                          version=version, spec=spec)
        assert "vllm.mla-drafter-model-type" not in {f.rule for f in findings}


@pytest.mark.parametrize("target, version, probe, missing", [
    ("qwen2.5-vl-7b", "0.11.0", "image_token_index", True),    # the loader read image_token_index for every target
    ("qwen2.5-vl-7b", "0.11.1", "image_token_id", False),      # Qwen2.5-VL's own field from 0.11.1
    ("kimi-k2.5", "0.16.0", "image_token_index", True),        # before the hand table's 0.17.0
    ("kimi-k2.5", "0.18.0", "media_placeholder_token_id", False),
    ("qwen2.5-vl-7b", "0.9.1", None, False),                   # no multimodal probe in the loader yet
])
def test_the_multimodal_probe_is_the_field_the_release_loader_reads(tmp_path, target, version, probe, missing):
    """vLLM's drafter loader copies an image-token id from a multimodal target (from 0.9.2), per architecture:
    engine_facts.json multimodal_probe_map, read from each release's eagle.py / llm_base_proposer.py."""
    if target == "kimi-k2.5":
        drafter = DRAFTERS / "kimi-k25-eagle3-specforge"
    else:  # a Qwen2.5-VL-7B drafter shape
        drafter = llama_drafter(tmp_path, hidden_size=3584, vocab_size=152064, num_attention_heads=28,
                                max_position_embeddings=128000)
    _, facts = run(TARGETS / target, drafter, version=version, spec={"method": "eagle3", "num_speculative_tokens": 3})
    assert (facts["target_probe_attr"], facts["target_probe_missing"]) == (probe, missing)


@pytest.mark.parametrize("arch, version, registered", [
    ("LlamaForCausalLMEagle3", "0.10.0", False),  # Eagle3LlamaForCausalLMEagle3: no such class
    ("LlamaForCausalLMEagle3", "0.10.1", True),   # kept as is and registered from 0.10.1
    ("LlamaForCausalLM", "0.9.2", True),          # the original EAGLE-3 release: Eagle3LlamaForCausalLM
    ("Qwen3ForCausalLM", "0.20.0", False),        # Eagle3Qwen3ForCausalLM only from 0.24.0
    ("Qwen3ForCausalLM", "0.24.0", True),
])
def test_the_drafter_class_vllm_builds_must_be_in_its_registry(tmp_path, arch, version, registered):
    """EAGLEConfig names the drafter class from architectures[0] (facts eagle3_arch_naming) and the registry must
    hold that name (facts arch_modules)."""
    drafter = llama_drafter(tmp_path, architectures=[arch])
    findings, facts = run(TARGETS / "llama-3.1-8b", drafter, version=version,
                          spec={"method": "eagle3", "num_speculative_tokens": 3})
    assert facts["spec_draft_arch_registered"] is registered
    assert ("vllm.draft-arch-unregistered" in errors(findings, "start")) is not registered


@pytest.mark.parametrize("version, env, topk, kind", [
    ("0.5.4.post1", "SGLANG_ENABLE_SPEC_V2=1 ", 4, "serve"), ("0.5.4", "SGLANG_ENABLE_SPEC_V2=1 ", 4, None),
    ("0.5.5.post3", "SGLANG_ENABLE_SPEC_V2=1 ", 4, "serve"), ("0.5.6", "SGLANG_ENABLE_SPEC_V2=true ", 4, "serve"),
    ("0.5.7", "SGLANG_ENABLE_SPEC_V2=1 ", 4, "start"), ("0.5.9", "SGLANG_ENABLE_SPEC_V2=1 ", 2, "start"),
    ("0.5.10.post1", "SGLANG_ENABLE_SPEC_V2=1 ", 4, "start"), ("0.5.11", "SGLANG_ENABLE_SPEC_V2=1 ", 4, None),
    ("0.5.13", "SGLANG_ENABLE_SPEC_V2=1 ", 4, None),
    ("0.5.9", "SGLANG_ENABLE_SPEC_V2=1 ", 1, None), ("0.5.9", "", 4, None), ("0.5.14", "SGLANG_ENABLE_SPEC_V2=1 ", 4, None)])
def test_sglang_spec_v2_runs_chain_drafts_only(tmp_path, version, env, topk, kind):
    """The V2 (overlap) EAGLE worker, per the table's spec_v2_topk: 0.5.4.post1-0.5.6.post2 take topk > 1 and die on
    the first decode batch (sglang#14077); 0.5.7-0.5.10.post1 refuse it in server-args validation; 0.5.11-0.5.13 turn
    the overlap schedule off for topk > 1 and run the V1 worker; 0.5.14 removed SGLANG_ENABLE_SPEC_V2."""
    drafter = llama_drafter(tmp_path, vocab_size=151936, max_position_embeddings=40960)
    args = (f"{env}--speculative-algorithm EAGLE3 --speculative-draft-model-path D --speculative-num-steps 5 "
            f"--speculative-eagle-topk {topk} --speculative-num-draft-tokens 8")
    findings, _ = check.run_checks(TARGETS / "qwen3-8b", drafter,
        CheckSettings(engine="sglang", engine_version=version, engine_args=args))
    rules = {f.rule: f.kind for f in findings if f.severity == "error" and f.rule.startswith("sglang.spec-v2")}
    assert rules == ({} if kind is None else {"sglang.spec-v2-topk" + ("-refused" if kind == "start" else ""): kind})


@pytest.mark.parametrize("version, unloadable", [
    ("0.8.5", False), ("0.29.0", False), ("0.30.0", True), ("0.32.0", True), ("0.33.0", True)])
def test_the_full_vocabulary_d2t_trap_per_release_is_the_one_the_wheel_holds(version, unloadable):
    """llama_eagle3.py builds draft_id_to_target_id for every drafter until 0.29.0 and only for a reduced vocabulary
    from 0.30.0, while load_weights keeps renaming d2t onto it (tests/test_check.py holds the rule to it)."""
    assert check.engine_release("vllm", version).facts["d2t_full_vocab_unloadable"] is unloadable


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_no_rule_carries_a_hand_typed_version_range(engine):
    """Which releases a rule applies to is read out of the wheels (a fact the rule names), not typed by hand: a
    range typed from the few releases someone read drifts (vllm.d2t-full-vocab held from 0.33.0, the wheels say
    0.30.0; sglang.spec-v2-topk-refused to 0.5.13, the wheels say 0.5.11 already falls back to the V1 worker)."""
    assert [r.id for r in check.load_rules(engine).rules if r.versions] == []


@pytest.mark.parametrize("version, reads", [("0.14.1", False), ("0.15.0", True), ("0.15.1", True), ("0.16.0", False)])
def test_the_mrope_positions_bug_per_release_is_the_one_the_wheel_holds(version, reads):
    """EagleProposer.propose reads self.positions in its M-RoPE branch, never allocated for an M-RoPE drafter."""
    assert check.engine_release("vllm", version).facts["mrope_propose_reads_positions"] is reads


@pytest.mark.parametrize("version, grouped", [("0.8.5", False), ("0.10.2", False), ("0.11.0", True), ("0.33.0", True)])
def test_the_kv_page_grouping_per_release_is_the_one_the_wheel_holds(version, grouped):
    """kv_cache_utils.py groups full-attention layers of different page sizes (UniformTypeKVCacheSpecs) from 0.11.0."""
    assert check.engine_release("vllm", version).facts["kv_mixed_page_groups"] is grouped


@pytest.mark.parametrize("version, over, engine_args, fires", [
    ("0.10.2", {"num_attention_heads": 64}, "", True),  # no head_dim: 4096 / 64 = 64 against the target's 128
    ("0.9.2", {"num_attention_heads": 64}, "", True),
    ("0.11.0", {"num_attention_heads": 64}, "", False),  # UniformTypeKVCacheSpecs groups them
    ("0.10.2", {"num_attention_heads": 64, "head_dim": 128}, "", False),
    ("0.10.2", {"num_key_value_heads": 4}, "", True),  # 4 x 128 against 8 x 128 per rank
    ("0.10.2", {"num_key_value_heads": 4}, "--tensor-parallel-size 8", False)])  # 1 x 128 on every rank either way
def test_vllm_before_0_11_refuses_a_drafter_whose_kv_pages_differ_from_the_target(tmp_path, version, over,
                                                                                   engine_args, fires):
    """vLLM < 0.11 allocates the drafter's KV cache with the target's and raises NotImplementedError unless every
    layer's KV spec, or page size, is the same (v1/core/kv_cache_utils.py get_kv_cache_config; vllm#25125)."""
    drafter = llama_drafter(tmp_path, vocab_size=151936, max_position_embeddings=40960, **over)
    findings, facts = run(TARGETS / "qwen3-8b", drafter, version=version,
                          spec={"method": "eagle3", "num_speculative_tokens": 3}, engine_args=engine_args)
    assert facts["kv_page_mismatch"] is (fires or version == "0.11.0")
    assert ("vllm.kv-page-mismatch" in errors(findings, "start")) is fires


@pytest.mark.parametrize("version, rope, k, fires", [
    ("0.15.1", {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, 3, True),
    ("0.15.0", {"rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]}}, 2, True),
    ("0.15.1", {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, 1, False),  # exits before
    ("0.14.1", {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, 3, False),
    ("0.16.0", {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, 3, False),
    ("0.15.1", {}, 3, False)])
def test_vllm_0_15_dies_on_the_first_request_with_an_mrope_drafter(tmp_path, version, rope, k, fires):
    """vLLM 0.15.x allocates only mrope_positions for an M-RoPE drafter and then reads self.positions in propose
    (v1/spec_decode/eagle.py:406; vllm#34607)."""
    drafter = llama_drafter(tmp_path, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                            vocab_size=152064, **rope)
    findings, _ = run(TARGETS / "qwen2.5-vl-7b", drafter, version=version,
                      spec={"method": "eagle3", "num_speculative_tokens": k})
    assert ("vllm.mrope-drafter-positions" in errors(findings, "serve")) is fires


@pytest.mark.parametrize("version, forced, default", [
    ("0.11.0", ["v1"], "off"), ("0.12.0", [], "off"), ("0.17.0", ["v2"], "off"), ("0.28.0", ["v2"], "some"),
    ("0.29.0", ["v2"], "all"), ("0.32.0", ["v2"], "all"), ("0.33.0", [], "all"), ("0.34.0", [], "only")])
def test_which_runner_ignores_use_aux_hidden_state_per_release_is_the_one_the_wheel_holds(version, forced, default):
    """V1 to 0.11.x and MRV2 from 0.17.0 to 0.32.x turn on aux outputs for every eagle3 drafter; MRV2 is the default
    runner for some targets from 0.22.0 and for all from 0.29.0 (config/vllm.py use_v2_model_runner)."""
    facts = check.engine_release("vllm", version).facts
    assert facts["aux_forced_runners"] == forced and facts["mrv2_default"] == default


@pytest.mark.parametrize("version, env, use_aux, rule", [
    ("0.30.0", "", False, "vllm.aux-forced"),  # MRV2 by default, which ignores the flag
    ("0.30.0", "VLLM_USE_V2_MODEL_RUNNER=0", False, None),  # V1 reads it
    ("0.30.0", "", True, None),  # a drafter trained on aux states gets what it wants
    ("0.33.0", "VLLM_USE_V2_MODEL_RUNNER=1", False, None),  # MRV2 reads it from 0.33.0
    ("0.20.0", "", False, None),  # V1 by default (0.12.0-0.21.x read the flag)
    ("0.20.0", "VLLM_USE_V2_MODEL_RUNNER=1", False, "vllm.aux-forced"),
    ("0.25.0", "", False, "vllm.aux-forced-maybe"),  # MRV2 by default for some architectures only
    ("0.11.0", "", False, "vllm.aux-forced")])  # V1 before it read the flag
def test_a_drafter_without_aux_states_is_warned_where_the_runner_feeds_it_aux_states(tmp_path, version, env, use_aux,
                                                                                    rule):
    drafter = llama_drafter(tmp_path, eagle_config={"use_aux_hidden_state": use_aux})
    findings, facts = run(TARGETS / "llama-3.1-8b", drafter, version=version,
                          spec={"method": "eagle3", "num_speculative_tokens": 3}, engine_args=env)
    fired = {f.rule for f in findings if f.severity == "warning" and f.rule.startswith("vllm.aux-forced")}
    assert fired == ({rule} if rule else set())
    if rule == "vllm.aux-forced":
        message = next(f.message for f in findings if f.rule == rule)
        assert ("Model Runner V2" if facts["vllm_runner"] == "v2" else "V1 model runner") in message


@pytest.mark.parametrize("version, kind, kv, layer_types", [
    ("0.8.5", "fixed3", False, False), ("0.10.0", "fixed3", False, False), ("0.10.1.1", "fixed3", False, True),
    ("0.10.2", "fixed3", False, False), ("0.11.0", "fixed3", True, False), ("0.21.0", "fixed3", True, False),
    ("0.22.0", "configured", True, False), ("0.34.0", "configured", True, False)])
def test_how_each_release_builds_the_drafter_is_what_its_wheel_holds(version, kind, kv, layer_types):
    """llama_eagle3.py sizes fc x3 until 0.21.x and from the config from 0.22.0; its decoder layer gets the cache
    config from 0.11.0; llama.py reads layer_types[layer_idx] unshifted in 0.10.1-0.10.1.1 (scripts/engine_facts.py)."""
    facts = check.engine_release("vllm", version).facts
    assert (facts["fc_aux_count"], facts["draft_layer_kv_config"], facts["layer_types_unshifted"]) == (kind, kv,
                                                                                                        layer_types)


FOUR_IDS = [2, 16, 29, 31]


@pytest.mark.parametrize("version, layout, fires", [
    ("0.28.0", "speculators", True),  # the adapter copies the ids to the top level only: fc for 3 (vllm#54526)
    ("0.34.0", "speculators", True),
    ("0.28.0", "eagle_config", False),  # fc sized from eagle_config's ids
    ("0.28.0", "num_aux", False),  # ... or from num_aux_hidden_states
    ("0.28.0", "top-level", True),  # top-level ids alone do not size fc
    ("0.21.0", "eagle_config", True),  # fc hard-wired to 3 x hidden
    ("0.28.0", "three", False)])
def test_a_drafter_with_four_aux_layers_fails_where_vllm_builds_fc_for_three(tmp_path, version, layout, fires):
    base = {"top-level": {"eagle_aux_hidden_state_layer_ids": FOUR_IDS},
            "eagle_config": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": FOUR_IDS}},
            "num_aux": {"eagle_aux_hidden_state_layer_ids": FOUR_IDS, "num_aux_hidden_states": 4},
            "three": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": FOUR_IDS[:3]}}}
    if layout == "speculators":
        drafter = write(tmp_path / "drafter-eagle3", {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 32000,
            "eagle_aux_hidden_state_layer_ids": FOUR_IDS, "target_hidden_size": 4096,
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 3}], "default_proposal_method": "greedy",
                "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "architectures": ["LlamaForCausalLM"]}},
            "transformer_layer_config": {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
                                         "num_key_value_heads": 8, "num_hidden_layers": 1, "vocab_size": 128256,
                                         "intermediate_size": 14336, "max_position_embeddings": 131072}})
    else:
        drafter = llama_drafter(tmp_path, **base[layout])
    findings, facts = run(TARGETS / "llama-3.1-8b", drafter, version=version,
                          spec={"method": "eagle3", "num_speculative_tokens": 3})
    assert ("vllm.fc-aux-count" in errors(findings, "start")) is fires
    assert facts["drafter_aux_count"] == (3 if layout == "three" else 4)


@pytest.mark.parametrize("version, kv, fires", [
    ("0.10.2", "--kv-cache-dtype fp8", True), ("0.9.2", "--kv-cache-dtype=fp8_e4m3", True),
    ("0.11.0", "--kv-cache-dtype fp8", False), ("0.10.2", "", False), ("0.10.2", "--kv-cache-dtype auto", False)])
def test_an_fp8_kv_cache_kills_the_first_request_where_the_drafter_layer_lacks_the_cache_config(tmp_path, version, kv,
                                                                                                fires):
    findings, facts = run(TARGETS / "llama-3.1-8b", llama_drafter(tmp_path), version=version,
                          spec={"method": "eagle3", "num_speculative_tokens": 3}, engine_args=kv)
    assert ("vllm.draft-kv-fp8" in errors(findings, "serve")) is fires


@pytest.mark.parametrize("version, layer_types, fires", [
    ("0.10.1.1", ["full_attention"], True), ("0.10.1", ["full_attention"], True),
    ("0.10.2", ["full_attention"], False), ("0.10.1.1", None, False),
    ("0.10.1.1", ["full_attention"] * 40, False)])  # long enough to hold index 32
def test_a_drafter_layer_types_list_is_read_past_its_end_in_vllm_0_10_1(tmp_path, version, layer_types, fires):
    over = {"layer_types": layer_types} if layer_types else {}
    findings, _ = run(TARGETS / "llama-3.1-8b", llama_drafter(tmp_path, **over), version=version,
                      spec={"method": "eagle3", "num_speculative_tokens": 3})
    assert ("vllm.drafter-layer-types" in errors(findings, "start")) is fires


@pytest.mark.parametrize("version, fires", [("0.5.1.post3", False), ("0.5.2", True), ("0.5.3", False)])
def test_sglang_0_5_2_unpacks_qwen2_aux_states_twice(tmp_path, version, fires):
    """qwen2.py's forward repeats the unpack in 0.5.2 only (SpecForge#231, sglang PR #10517)."""
    assert ("qwen2" in check.engine_release("sglang", version).facts["aux_unpacked_twice"]) is fires
    drafter = llama_drafter(tmp_path, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                            vocab_size=152064)
    target = write(tmp_path / "qwen2.5-7b", {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
        "max_position_embeddings": 32768, "torch_dtype": "bfloat16"})
    findings, _ = run(target, drafter, engine="sglang", version=version,
                      engine_args="--speculative-algorithm EAGLE3 --speculative-draft-model-path D")
    assert ("sglang.aux-unpacked-twice" in errors(findings, "start")) is fires


@pytest.mark.parametrize("version, fires", [("0.5.10", False), ("0.5.11", True), ("0.5.21", True), ("0.5.22", False)])
def test_sglang_qwen3_5_inherits_a_capture_hook_its_language_model_ignores(tmp_path, version, fires):
    """qwen3_5.py's wrapper inherits Qwen3-VL's hook (it sets layers_to_capture) while its language model collects
    only layers flagged _is_layer_to_capture, 0.5.11-0.5.21 (sglang#38307)."""
    facts = check.engine_release("sglang", version).facts
    assert ("Qwen3_5MoeForConditionalGeneration" in facts["capture_ignored_archs"]) is fires
    target = write(tmp_path / "qwen3.5", {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 248320, "head_dim": 256,
                        "max_position_embeddings": 262144},
        "vision_config": {"hidden_size": 1152}, "torch_dtype": "bfloat16"})
    drafter = llama_drafter(tmp_path, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                            vocab_size=248320)
    findings, _ = run(target, drafter, engine="sglang", version=version,
                      engine_args="--speculative-algorithm EAGLE3 --speculative-draft-model-path D")
    assert ("sglang.capture-ignored" in errors(findings, "start")) is fires
