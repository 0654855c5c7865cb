"""Read safetensors headers (names, dtypes, shapes) without touching weight data.

A safetensors file starts with an 8-byte little-endian header length, then that many bytes of JSON:
`{"name": {"dtype": "BF16", "shape": [..], "data_offsets": [a, b]}, "__metadata__": {...}}`.
Reading it costs one small read per file, so a 64-shard, 500 GB checkpoint is described in
milliseconds. Sharded checkpoints are found through `model.safetensors.index.json` (its `weight_map`
names the shard of every tensor).

Run: `python -m draftsmith.preflight.safetensors_header DIR` prints the tensor count and dtypes of a model dir.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import DraftsmithError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# The format allows large headers, but a header past this size is a corrupt or hostile file.
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own reader uses the same limit (100 MB)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its header describes it."""

    dtype: str
    """Safetensors dtype code: BF16, F16, F32, I64, BOOL, ..."""
    shape: tuple[int, ...]
    file: str
    """File name (within the model directory) that holds the tensor."""


@dataclass
class ModelTensors:
    """All tensors of a model directory, read from headers only."""

    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    """Shard files whose headers were read."""
    missing_files: list[str] = field(default_factory=list)
    """Shards named by the index that are not on disk."""
    unindexed: list[str] = field(default_factory=list)
    """Tensors the index maps to a shard whose header does not contain them."""

    def dtypes(self) -> dict[str, int]:
        """Tensor count per dtype."""
        counts: dict[str, int] = {}
        for info in self.tensors.values():
            counts[info.dtype] = counts.get(info.dtype, 0) + 1
        return counts


def read_header(path: Path) -> dict:
    """The raw JSON header of one safetensors file (8-byte length, then JSON; nothing else is read).

    Raises:
        DraftsmithError: the file is too short, the length is implausible, or the JSON is invalid.
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise DraftsmithError("not a safetensors file", got=f"{path} has {len(head)} bytes",
                                  expected="an 8-byte header length followed by a JSON header",
                                  fix="re-download or re-export the file")
        (length,) = struct.unpack("<Q", head)
        size = path.stat().st_size
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise DraftsmithError("corrupt safetensors header", got=f"{path}: header length {length}, file {size} bytes",
                                  expected=f"a header length below {MAX_HEADER_BYTES} and the file size",
                                  fix="re-download or re-export the file")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DraftsmithError("corrupt safetensors header", got=f"{path}: {exc}",
                              expected="a JSON object after the 8-byte length",
                              fix="re-download or re-export the file") from exc
    ends = [meta["data_offsets"][1] for meta in header.values() if isinstance(meta, dict)
            and isinstance(meta.get("data_offsets"), list) and len(meta["data_offsets"]) == 2] \
        if isinstance(header, dict) else []
    if ends and 8 + length + max(ends) != size:  # what safetensors' own loader (and with it every engine) refuses
        raise DraftsmithError("cut or padded safetensors file", got=f"{path}: {size} bytes",
                              expected=f"{8 + length + max(ends)} bytes: the 8-byte length, the header and the "
                                       "tensor data its offsets cover", fix="re-download or re-export the file")
    return header


def tensors_of(path: Path) -> dict[str, TensorInfo]:
    """Tensors of one safetensors file, by name."""
    header = read_header(path)
    return {name: TensorInfo(dtype=str(meta.get("dtype")), shape=tuple(int(d) for d in meta.get("shape", ())),
                             file=Path(path).name)
            for name, meta in header.items() if name != "__metadata__" and isinstance(meta, dict)}


def read_model_tensors(model_dir: Path) -> ModelTensors:
    """Every tensor of a model directory, from its index (if any) and each shard's header.

    Args:
        model_dir: a directory with `model.safetensors`, or `model.safetensors.index.json` plus shards,
            or any `*.safetensors` files.
    Returns:
        `ModelTensors`; empty when the directory holds no safetensors at all.
    """
    model_dir = Path(model_dir)
    out = ModelTensors()
    index = model_dir / INDEX_NAME
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (model_dir / shard).is_file():
                out.missing_files.append(shard)
                continue
            out.tensors.update(tensors_of(model_dir / shard))
            out.files.append(shard)
        out.unindexed = sorted(n for n, s in weight_map.items() if s in out.files and n not in out.tensors)
        return out
    files = [model_dir / SINGLE_NAME] if (model_dir / SINGLE_NAME).is_file() else sorted(model_dir.glob("*.safetensors"))
    for path in files:
        out.tensors.update(tensors_of(path))
        out.files.append(path.name)
    return out


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m draftsmith.preflight.safetensors_header MODEL_DIR", file=sys.stderr)
        return 2
    found = read_model_tensors(Path(args[0]))
    print(f"{len(found.tensors)} tensors in {len(found.files)} files; dtypes {found.dtypes()}")
    if found.missing_files:
        print(f"missing shards: {found.missing_files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
