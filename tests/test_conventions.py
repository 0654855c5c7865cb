"""Every (engine, version range, trainer) reading of aux ids, from the one table in `draftsmith.conventions`.

The matrix writes a drafter config the way each trainer (or draftsmith export format) writes it, then
asks what each engine captures; the expected boundary indices come from the engines' source as cited
in conventions.py, not from the code under test.
"""

from __future__ import annotations

import pytest
from packaging.version import Version

from draftsmith.conventions import (
    AUX_KEY,
    ENGINES,
    FORMAT_READER,
    TRAINER_CONVENTIONS,
    aux_ids_for_format,
    aux_reading,
    MIN_DEFAULT_LAYERS,
    default_aux_ids,
    engine_aux_ids,
    engine_default_aux_ids,
    engine_reads,
    facts_table,
    find_aux_ids,
    infer_boundary,
    to_boundary,
    trainer_default,
    validate_aux_ids,
)
from draftsmith.errors import DraftsmithError

N = 32  # Llama-3.1-8B depth: EAGLE-3's default boundary triple is (2, 16, 29)
DEFAULT = (2, 16, 29)
TRAINED = (3, 10, 20)  # non-default boundary ids, so a misread is visible


def top(ids):
    return {AUX_KEY: list(ids)}


def nested(ids):
    return {"eagle_config": {AUX_KEY: list(ids)}}


# How each producer writes TRAINED (boundary 3, 10, 20) into config.json.
WRITTEN = {
    "specforge": nested([2, 9, 19]),  # layer outputs, in eagle_config (SpecForge configs)
    "modelopt": nested([2, 9, 19]),  # layer outputs, always written, in eagle_config (hf_spec_export.py)
    "speculators": top([3, 10, 20]),  # boundaries at the top level (speculators config)
    "export-vllm": nested([3, 10, 20]),  # draftsmith export --format vllm
    "export-sglang": nested([2, 9, 19]),  # draftsmith export --format sglang (boundary - 1)
    "export-llamacpp": {**top([3, 10, 20]), **nested([3, 10, 20])},  # --format llamacpp: both places
}

# (producer, engine, version, boundary indices the engine captures)
READINGS = [
    # vLLM, as boundary indices, where the facts table says the release reads them: nowhere before 0.11.1,
    # the top level only 0.11.1-0.21.0 (0.18.0 gpu_model_runner.py `hasattr(hf_config, ...)`), then eagle_config
    ("specforge", "vllm", "0.22.0", (2, 9, 19)),  # one layer early: the SpecForge-on-vLLM misread
    ("specforge", "vllm", "0.17.0", DEFAULT),  # nested ids not read: vLLM's default is captured
    ("modelopt", "vllm", "0.33.0", (2, 9, 19)),
    ("speculators", "vllm", "0.33.0", TRAINED),
    ("speculators", "vllm", "0.18.0", TRAINED),  # top-level ids are read from 0.11.1
    ("speculators", "vllm", "0.11.0", DEFAULT),  # and by no release before it
    ("export-vllm", "vllm", "0.9.2", DEFAULT),
    ("export-vllm", "vllm", "0.18.0", DEFAULT),  # draftsmith's vllm export nests them: 0.18.0 ignores them
    ("export-vllm", "vllm", "0.22.0", TRAINED),
    ("export-sglang", "vllm", "0.33.0", (2, 9, 19)),
    ("export-llamacpp", "vllm", "0.33.0", TRAINED),
    # SGLang: eagle_config only, +1 (layer outputs), from 0.4.9 (facts table); nothing before
    ("specforge", "sglang", "0.5.23", TRAINED),
    ("modelopt", "sglang", "0.4.9", TRAINED),
    ("modelopt", "sglang", "0.4.6.post5", DEFAULT),
    ("speculators", "sglang", "0.5.23", DEFAULT),  # top-level ids are not read: the default is captured
    ("export-vllm", "sglang", "0.5.23", (4, 11, 21)),  # one layer late
    ("export-sglang", "sglang", "0.5.14", TRAINED),
    ("export-llamacpp", "sglang", "0.5.23", (4, 11, 21)),
    # llama.cpp 0.3.36 (its converter): top level only, boundary indices
    ("specforge", "llamacpp", "0.3.36", DEFAULT),
    ("speculators", "llamacpp", "0.3.36", TRAINED),
    ("export-vllm", "llamacpp", "0.3.36", DEFAULT),  # ids only in eagle_config: the converter's default
    ("export-llamacpp", "llamacpp", "0.3.36", TRAINED),
]


@pytest.mark.parametrize("producer,engine,version,want", READINGS,
                         ids=[f"{p}-on-{e}-{v}" for p, e, v, _ in READINGS])
def test_each_engine_reads_each_producers_ids(producer, engine, version, want):
    assert engine_reads(WRITTEN[producer], N, engine, version) == want


@pytest.mark.parametrize("engine,version", [("vllm", "0.33.0"), ("sglang", "0.5.23"), ("llamacpp", "0.3.36")])
def test_no_explicit_ids_means_the_eagle3_default_everywhere(engine, version):
    assert engine_reads({}, N, engine, version) == DEFAULT == default_aux_ids(N)
    assert engine_reads({"eagle_config": {}}, N, engine, version) == DEFAULT


def test_vllm_prefers_the_top_level_ids():
    config = {**top([5, 6, 7]), **nested([8, 9, 10])}
    assert engine_reads(config, N, "vllm") == (5, 6, 7)
    assert find_aux_ids(config) == ([5, 6, 7], "top-level")
    assert find_aux_ids(config, ("eagle_config",)) == ([8, 9, 10], "eagle_config")


def test_every_engine_row_covers_the_versions_draftsmith_checks():
    assert set(ENGINES) == {"vllm", "sglang", "llamacpp"}
    for engine, version in (("vllm", "0.8.5"), ("vllm", "0.33.0"), ("sglang", "0.4.6.post5"), ("sglang", "0.5.23"),
                            ("llamacpp", "0.3.36")):
        assert aux_reading(engine, version).engine == engine
    with pytest.raises(DraftsmithError, match="no known aux-id reading for vllm 0.7.3"):
        aux_reading("vllm", "0.7.3")  # older than every release in the facts table
    with pytest.raises(DraftsmithError, match="unknown engine"):
        aux_reading("tgi")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_table_engines_read_ids_exactly_where_the_facts_table_says(engine):
    """One home: every release's reading is the table's aux_ids_read / aux_ids_from_eagle_config."""
    for release, row in facts_table()[engine].items():
        reading = aux_reading(engine, release)
        assert bool(reading.locations) == row["aux_ids_read"], release
        assert ("eagle_config" in reading.locations) == (row["aux_ids_read"] and row["aux_ids_from_eagle_config"])
        assert release in reading.source
    assert aux_reading("vllm", "0.10.2").locations == ()
    assert aux_reading("vllm", "0.18.0").locations == ("top-level",)
    assert aux_reading("vllm").locations == ("top-level", "eagle_config")  # the newest release


def test_a_release_between_table_rows_reads_like_the_one_before_it():
    assert aux_reading("vllm", "0.13.1").versions == "==0.13.0"
    assert aux_reading("sglang", "0.5.6.post3").versions == "==0.5.6.post2"  # no wheel read for post3: the row before
    assert aux_reading("sglang", "0.5.6").versions == "==0.5.6"  # every release's wheel is read (scripts/engine_facts.py)
    assert aux_reading("vllm", "99.0.0").versions == f"=={max(facts_table()['vllm'], key=Version)}"


@pytest.mark.parametrize("fmt", sorted(FORMAT_READER))
def test_written_ids_read_back_as_the_trained_boundaries(fmt):
    ids = aux_ids_for_format(TRAINED, fmt)
    config = {**top(ids), **nested(ids)} if fmt in ("llamacpp", "speculators") else nested(ids)
    assert engine_reads(config, N, FORMAT_READER[fmt]) == TRAINED


def test_boundary_zero_has_no_sglang_id():
    assert aux_ids_for_format((0, 16, 29), "vllm") == [0, 16, 29]
    with pytest.raises(DraftsmithError, match="cannot be written as a layer output"):
        aux_ids_for_format((0, 16, 29), "sglang")
    with pytest.raises(DraftsmithError, match="unknown engine convention"):
        aux_ids_for_format(TRAINED, "tgi")


@pytest.mark.parametrize("trainer,written", [("eagle", [2, 16, 29]), ("speculators", [2, 16, 29]),
                                             ("draftsmith", [2, 16, 29]), ("specforge", [1, 15, 28]),
                                             ("modelopt", [1, 15, 28])])
def test_every_trainers_default_is_eagle3s_default_boundary(trainer, written):
    assert trainer_default(trainer, N) == written
    assert to_boundary(written, TRAINER_CONVENTIONS[trainer]) == DEFAULT


def test_modelopt_default_drops_duplicates_on_shallow_targets():
    assert trainer_default("specforge", 8) == [1, 3, 4]
    assert trainer_default("modelopt", 6) == [1, 2]  # sorted({1, 2, 2})


def test_ids_of_unknown_origin_are_inferred_only_from_default_forms():
    assert infer_boundary([2, 16, 29], N) == DEFAULT
    assert infer_boundary([1, 15, 28], N) == DEFAULT  # SpecForge / ModelOpt default, layer outputs
    assert infer_boundary([3, 10, 20], N) is None


def test_engine_aux_ids_trained_prefers_the_draftsmith_record():
    cfg = {"eagle_config": {AUX_KEY: [1, 15, 28]}, "draftsmith": {"aux_layer_ids_boundary": [2, 16, 29]}}
    assert engine_aux_ids(cfg, N, "vllm") == (1, 15, 28)
    assert engine_aux_ids(cfg, N, "sglang") == (2, 16, 29)
    assert engine_aux_ids(cfg, N, "trained") == (2, 16, 29)
    assert engine_aux_ids(nested([4, 5, 6]), N, "trained") == (4, 5, 6)
    assert engine_aux_ids({}, N, "vllm") == engine_aux_ids({}, N, "sglang") == engine_aux_ids({}, N, "trained") == DEFAULT


def test_every_target_of_seven_layers_or_more_keeps_eagle3s_default_triple():
    for n in range(7, 101):
        assert default_aux_ids(n) == (2, n // 2, n - 3) == engine_default_aux_ids(n), n


def test_every_target_of_four_layers_or_more_gets_three_distinct_ids_spread_early_middle_late():
    assert MIN_DEFAULT_LAYERS == 4
    assert {n: default_aux_ids(n) for n in (4, 5, 6)} == {4: (1, 2, 3), 5: (1, 2, 3), 6: (2, 3, 4)}
    for n in range(MIN_DEFAULT_LAYERS, 101):
        early, middle, late = ids = default_aux_ids(n)
        assert 1 <= early < middle < late <= n - 1, (n, ids)
        assert middle == n // 2 and early <= 2 and late >= n - 3, (n, ids)
        assert validate_aux_ids(ids, n) == ids


@pytest.mark.parametrize("n,fix", [(3, "--aux-ids 0,1,2"), (2, "at least 3 decoder layers"),
                                   (1, "at least 3 decoder layers"), (0, "at least 3 decoder layers")])
def test_a_target_too_shallow_for_a_default_is_one_error_naming_it_its_depth_and_the_fix(n, fix):
    with pytest.raises(DraftsmithError) as err:
        default_aux_ids(n, "target './tiny'")
    text = err.value.render()
    assert "target './tiny' has too few decoder layers" in text and f"{n} decoder layer" in text and fix in text
    with pytest.raises(DraftsmithError, match="no default at this depth"):
        validate_aux_ids((0, 0, 1), n)


def test_engines_still_capture_their_own_default_on_a_shallow_target_that_names_no_ids():
    """vLLM and SGLang compute (2, N//2, N-3) themselves (docs/engines.md §3.1), repeated layer and all: only
    explicit ids get a six-layer target's drafter what it was trained on."""
    assert engine_default_aux_ids(6) == (2, 3, 3) != default_aux_ids(6)
    for engine, version in (("vllm", "0.33.0"), ("sglang", "0.5.23"), ("llamacpp", "0.3.36")):
        assert engine_reads({}, 6, engine, version) == (2, 3, 3)
    assert trainer_default("eagle", 6) == [2, 3, 3] and infer_boundary([2, 3, 3], 6) == (2, 3, 3)
    assert infer_boundary([2, 3, 4], 6) is None  # draftsmith's own default is recorded, never inferred


@pytest.mark.parametrize("fmt", sorted(FORMAT_READER))
def test_a_six_layer_targets_default_ids_are_written_so_each_engine_reads_them_as_trained(fmt):
    from dataclasses import replace

    from conftest import CFG
    from draftsmith.export.formats import speculators_config
    from draftsmith.model.checkpoint import hf_config

    trained = default_aux_ids(6)
    cfg = replace(CFG, target_num_layers=6, aux_layer_ids=trained)
    config = speculators_config(cfg, "float32", "t", 3, {}) if fmt == "speculators" else hf_config(cfg, fmt)
    assert find_aux_ids(config)[0] is not None  # explicit: no engine falls back to its own (2, 3, 3)
    assert engine_reads(config, 6, FORMAT_READER[fmt]) == trained == engine_aux_ids(config, 6, "trained")
