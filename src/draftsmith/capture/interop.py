"""`draftsmith export-store STORE OUT --format speculators`: a feature store in a peer trainer's offline layout.

So that a peer trainer and draftsmith learn from the same tokens, masks and states (docs/peers.md). The one
peer layout today is vllm-project/speculators 0.9.0's offline data for EAGLE-3, as its trainer reads it
(`speculators/train/data.py` `ArrowDataset`, `hs_connectors/transfer.py` `FileTransfer`):

    OUT/hidden_states/hs_<i>.safetensors   per sample i: hidden_states bf16 [T, 4, H] (the 3 aux layers,
                                           then the target's final state *before* its last norm), token_ids
                                           int64 [T]; draftsmith adds loss_mask uint8 [T] (speculators reads
                                           only the first two keys)
    OUT/data-*.arrow, dataset_info.json,   the `datasets.save_to_disk` index speculators loads with
      state.json                           `load_from_disk`: columns input_ids, loss_mask (int64), seq_len
    OUT/token_freq.pt                      {token id: count over supervised tokens}, what `prepare-data`
                                           writes and `speculators train --draft-vocab-size` reads
    OUT/draftsmith_export.json             where it came from: the store, target, aux ids, sample count

The final state: speculators computes the target's logits as `verifier_lm_head(verifier_norm(h))` with
the target's own final RMSNorm (`models/eagle3/core.py`), so it expects h before that norm, as vLLM's
hidden-state extraction writes it. draftsmith's store keeps the state after the norm, y = w * x / rms(x).
The export writes y / w: its rms is 1 (to within the norm's eps), so the target's norm maps it back to
y, to within bf16 rounding. Tokens, masks and aux states are copied bit for bit.

OUT is draftsmith's (`draftsmith.outputs`): one that holds files draftsmith did not write is refused before the
store is read (`--overwrite` replaces it), and so is one that overlaps the store; the export is written into a
temporary sibling and swapped in whole, so a failure leaves an earlier export as it was.

The export streams: one sample is read from the memory-mapped store and written at a time. The Arrow
index needs the `datasets` package (speculators depends on it); without it the hidden-state files are
still written and the command says how to add the index (`--index-only`, where `datasets` is installed).

    draftsmith export-store runs/demo/store runs/demo/speculators-data --format speculators
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import model_validator
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.config import JSON_FLAG, Settings, add_flags, check_choices, from_flags
from draftsmith.errors import DraftsmithError
from draftsmith.outputs import check_not_inside, check_output, replace_dir, umask_mode
from draftsmith.progress import progress_bar
from draftsmith.capture.store import SHARD_TENSORS, FeatureStore, Sample
from draftsmith.target import read_config, resolve_target, text_config_of

FORMATS = ("speculators",)
HS_DIR = "hidden_states"  # speculators: FileTransfer(Path(datapath) / "hidden_states")
TOKEN_FREQ = "token_freq.pt"  # speculators: prepare-data's default token_freq_path
EXPORT_INFO = "draftsmith_export.json"
INDEX_FILES = ("dataset_info.json", "state.json")  # plus data-*.arrow, as datasets.save_to_disk writes them


def hs_path(out: Path, i: int) -> Path:
    return Path(out) / HS_DIR / f"hs_{i}.safetensors"


@dataclass(frozen=True)
class FinalNorm:
    """The target's last RMSNorm: weight (H,) and eps."""

    weight: torch.Tensor
    eps: float

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm as HF Llama computes it (in fp32, then back to x's dtype). x (..., H)."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)

    def undo(self, y: torch.Tensor) -> torch.Tensor:
        """A state whose norm is y: y / w (its rms is 1). y (..., H) -> same shape, y's dtype."""
        return (y.float() / self.weight.float()).to(y.dtype)


def final_norm(model_dir: Path) -> FinalNorm:
    """Read `model.norm.weight` (or a text model's `model.language_model.norm.weight`) from the safetensors.

    Raises:
        DraftsmithError: no such tensor, or a zero weight (y / w would be infinite).
    """
    names = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            name = next((n for n in names if n in f.keys()), None)
            if name:
                weight = f.get_tensor(name)
                break
    else:
        raise DraftsmithError("the target's final norm weight was not found", got=f"no {names[0]} in "
                              f"{model_dir}/*.safetensors", expected="a Hugging Face safetensors target directory",
                              fix="pass --target with the model directory the store was captured from")
    if bool((weight == 0).any()):
        raise DraftsmithError("the target's final norm has zero weights", got=f"{int((weight == 0).sum())} zeros",
                              expected="a non-zero weight per channel (the export divides by it)",
                              fix="this target's pre-norm state cannot be recovered from the store; "
                              "capture through vLLM's hidden-state extraction instead")
    eps = text_config_of(read_config(model_dir)).get("rms_norm_eps") or 1e-6
    return FinalNorm(weight, float(eps))


def write_sample(path: Path, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor,
                 pre_norm_last: torch.Tensor) -> None:
    """One hs_<i>.safetensors, atomically. aux (T, 3H), pre_norm_last (T, H) -> hidden_states (T, 4, H)."""
    T, H = pre_norm_last.shape
    layers = torch.cat([aux.reshape(T, 3, H), pre_norm_last.reshape(T, 1, H)], dim=1)  # (T, 4, H)
    tensors = {"hidden_states": layers.to(torch.bfloat16).contiguous(), "token_ids": input_ids.to(torch.int64),
               "loss_mask": loss_mask.to(torch.uint8)}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    os.chmod(tmp, umask_mode())  # safetensors writes 0600: a trainer of another user of the group reads it
    os.replace(tmp, path)


def token_frequencies(counts: torch.Tensor) -> dict[int, int]:
    """speculators' token_freq.pt content: {token id: count} for every supervised token id."""
    ids = torch.nonzero(counts).flatten()
    return {int(i): int(counts[i]) for i in ids}


def samples_by_shard(store: FeatureStore) -> Iterator[Sample]:
    """Every sample in store order, one shard open at a time (each verified against its sha256 first)."""
    for i, entry in enumerate(store.manifest["shards"]):
        store.verify_shard(i)
        with safe_open(str(store.root / entry["file"]), framework="pt") as f:
            offsets = f.get_tensor("offsets")
            for j in range(entry["num_samples"]):
                a, b = int(offsets[j]), int(offsets[j + 1])
                yield Sample(*(f.get_slice(name)[a:b] for name in SHARD_TENSORS))


def is_export(out: Path) -> bool:
    """`out` holds this verb's own manifest (an export from before the marker counts as draftsmith's)."""
    return (Path(out) / EXPORT_INFO).is_file()


def export_speculators(store_dir: Path, out: Path, target: str | None = None, index: bool = True,
                       overwrite: bool = False) -> dict:
    """Write the store in speculators' offline layout; returns the summary written to draftsmith_export.json.

    Args:
        target: the target's name or directory (default: the one recorded in the store).
        index: also write the Arrow index (needs `datasets`); False writes only the per-sample files.
        overwrite: replace an `out` that draftsmith did not write.
    Raises:
        DraftsmithError: an `out` of the user's (without `overwrite`) or one overlapping the store, before
            the store is read.
    """
    check_not_inside(out, store_dir, "export-store")
    check_output(out, "export-store", overwrite, flag="OUT", owns=is_export)
    store = FeatureStore(Path(store_dir))
    target = target or store.identity["target"]["name"]
    norm = final_norm(resolve_target(target))
    with replace_dir(Path(out).resolve(), "export-store", overwrite, flag="OUT", owns=is_export) as tmp:
        (tmp / HS_DIR).mkdir()
        tokens = 0
        with progress_bar("export-store", total=len(store), unit="samples") as bar:
            for k, s in enumerate(samples_by_shard(store)):
                write_sample(hs_path(tmp, k), s.input_ids, s.loss_mask, s.aux, norm.undo(s.last))
                tokens += len(s.input_ids)
                bar.advance(1, tokens=tokens)
        torch.save(token_frequencies(store.token_counts()), tmp / TOKEN_FREQ)
        info = {"format": "speculators", "speculators_version": "0.9.0", "store": str(Path(store_dir).resolve()),
                "target": target, "aux_layer_ids": store.identity["aux_layer_ids"], "aux_id_convention": "boundary",
                "hidden_size": store.hidden_size, "num_samples": len(store), "num_tokens": tokens,
                "final_state": "pre-norm: store's post-norm state / final norm weight"}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        info["index"] = write_index(tmp, Path(out)) if index else "skipped"
    return info


def index_rows(out: Path) -> Iterator[dict]:
    """The rows of the Arrow index, read back from the hidden-state files in index order (their token ids
    and masks only: the states stay on disk)."""
    n = json.loads((Path(out) / EXPORT_INFO).read_text())["num_samples"]
    for i in range(n):
        with safe_open(str(hs_path(out, i)), framework="pt") as f:
            ids, mask = f.get_tensor("token_ids"), f.get_tensor("loss_mask")
        yield {"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "seq_len": len(ids)}


def write_index(out: Path, shown: Path | None = None) -> str:
    """The `datasets` index speculators loads, written into `out`; 'written', or why not (the package is
    absent; the fix names `shown`, the export's final place, default `out`)."""
    try:
        import datasets
    except ImportError:
        return ("not written: `datasets` is not installed (speculators needs it anyway); install it "
                f"and run `draftsmith export-store STORE {shown or out} --format speculators --index-only`")
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    tmp = Path(out) / ".index.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    rows = datasets.Dataset.from_generator(index_rows, gen_kwargs={"out": Path(out)}, features=features,
                                           cache_dir=str(tmp / "cache"))
    # torch format, saved in state.json: speculators compares the rows with torch.equal (preprocessing.py
    # sets the same format before save_to_disk)
    rows.with_format("torch").save_to_disk(str(tmp / "index"))
    for file in (tmp / "index").iterdir():  # beside hidden_states/, as prepare-data + generate leave them
        os.replace(file, Path(out) / file.name)
    shutil.rmtree(tmp, ignore_errors=True)
    return "written"


@dataclass
class PeerSample:
    """One sample read back from a peer layout. input_ids int32 (T,), loss_mask uint8 (T,), aux bf16 (T, 3H),
    last (T, H): the final state as the peer stores it (pre-norm for speculators)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor


def read_speculators(out: Path) -> Iterator[PeerSample]:
    """Read an export back, sample by sample, in index order (hs_0, hs_1, ...).

    Raises:
        DraftsmithError: a missing hs_<i> file, or one that is not an EAGLE-3 sample of 3 aux + 1 final layer.
    """
    out = Path(out)
    info = json.loads((out / EXPORT_INFO).read_text()) if (out / EXPORT_INFO).is_file() else None
    n = info["num_samples"] if info else len(list((out / HS_DIR).glob("hs_*.safetensors")))
    for i in range(n):
        path = hs_path(out, i)
        if not path.is_file():
            raise DraftsmithError(f"speculators export is missing {path.name}", got=f"{n} samples expected",
                                  expected=f"{HS_DIR}/hs_0 .. hs_{n - 1}.safetensors",
                                  fix="rerun `draftsmith export-store` into an empty OUT")
        with safe_open(str(path), framework="pt") as f:
            hs, ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
            mask = f.get_tensor("loss_mask") if "loss_mask" in f.keys() else torch.ones_like(ids)
        if hs.dim() != 3 or hs.shape[1] != 4 or hs.shape[0] != len(ids):
            raise DraftsmithError(f"{path.name} is not a 3-aux-layer EAGLE-3 sample", got=f"hidden_states "
                                  f"{list(hs.shape)}, {len(ids)} token_ids", expected="[T, 4, H] and T token ids",
                                  fix="export it again with `draftsmith export-store`")
        T, _, H = hs.shape
        yield PeerSample(ids.to(torch.int32), mask.to(torch.uint8), hs[:, :3].reshape(T, 3 * H), hs[:, 3])


class ExportStoreSettings(Settings):
    """Which store `export-store` writes, where and in what layout: the export-store verb's command line."""

    store: Path
    """Feature store directory (written by `draftsmith capture`)."""
    out: Path
    """Output directory (speculators' --data-path)."""
    format: str = "speculators"
    """Peer layout: speculators."""
    target: str | None = None
    """Target name or directory (default: the store's)."""
    index_only: bool = False
    """Only (re)write the Arrow index of an existing export."""
    overwrite: bool = False
    """Replace an OUT that draftsmith did not write (its content is lost)."""
    as_json: bool = False
    """Print the summary as JSON."""

    @model_validator(mode="after")
    def check_format(self) -> ExportStoreSettings:
        check_choices(("--format", self.format, FORMATS))
        return self


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("export-store", help="write a feature store in a peer trainer's offline layout (speculators)",
                       **example_help(
                           "examples:\n"
                           "  draftsmith export-store runs/demo/store runs/demo/spec-data --format speculators\n"
                           "  speculators train --data-path runs/demo/spec-data --verifier-name-or-path TARGET_DIR \\\n"
                           "      --target-layer-ids 2 15 27 --draft-vocab-size 32000 ...   # ids: the store's, as is\n"
                           "  draftsmith export-store runs/demo/store runs/demo/spec-data --format speculators "
                           "--index-only\n"
                           "The Arrow index needs `pip install datasets`; the hidden-state files do not."))
    add_flags(p, ExportStoreSettings, positional=("store", "out"), flags=JSON_FLAG)
    p.set_defaults(func=run_export_store)


def require_export(out: Path) -> Path:
    """`out`, when it is an export this verb wrote (`--index-only` adds to it in place)."""
    if not is_export(out):
        raise DraftsmithError("--index-only adds the index to an existing export", got=f"no {EXPORT_INFO} in {out}",
                              expected="a folder written by `draftsmith export-store`",
                              fix="run `draftsmith export-store STORE OUT --format speculators` first")
    return Path(out)


def run_export_store(args) -> int:
    import contextlib
    import sys

    s = from_flags(ExportStoreSettings, args)
    # with --json, stdout carries the JSON alone: progress lines go to stderr
    with contextlib.redirect_stdout(sys.stderr) if s.as_json else contextlib.nullcontext():
        if s.index_only:
            info = {"index": write_index(require_export(s.out))}
        else:
            info = export_speculators(s.store, s.out, s.target, overwrite=s.overwrite)
    if s.as_json:
        print(json.dumps(info, indent=2))
    else:
        head = (f"export-store: {info['num_samples']} samples, {info['num_tokens']:,} tokens -> {s.out} "
                f"(speculators layout, aux ids {info['aux_layer_ids']}) | " if "num_samples" in info else "")
        print(f"{head}index: {info['index']}")
    return 0 if info["index"] in ("written", "skipped") else 1
