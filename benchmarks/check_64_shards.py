"""Wall time of `draftsmith check` on a 64-shard target (Kimi-K2.5 config, header-only sparse shards).

Run: `.venv/bin/python benchmarks/check_64_shards.py`; writes benchmarks/results/check_64_shards.json.
The shards are sparse files (~7 GiB apparent each, no data on disk), so only headers exist to read,
exactly what check reads on a real 547 GB checkpoint. The timed command is the CLI in a fresh process.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from test_check import DRAFTERS, make_sharded_target  # noqa: E402


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="check-64-"))
    try:
        target = make_sharded_target(work / "kimi-k2.5")
        drafter = work / "drafter"
        shutil.copytree(DRAFTERS / "kimi-k25-eagle3-specforge", drafter)
        cmd = [sys.executable, "-m", "draftsmith.preflight.check", "--target", str(target), "--drafter", str(drafter),
               "--engine", "vllm", "--engine-version", "0.18.0", "--json"]
        subprocess.run(cmd, capture_output=True, check=False)  # warm-up: imports, page cache
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            times.append(time.perf_counter() - t0)
        from draftsmith.preflight.check import CheckSettings, run_checks

        t0 = time.perf_counter()
        run_checks(target, drafter, CheckSettings(engine="vllm", engine_version="0.18.0"))
        in_process = time.perf_counter() - t0
        apparent = sum(p.stat().st_size for p in target.glob("*.safetensors"))
        out = {"command": " ".join(["draftsmith check"] + cmd[3:]).replace(str(work), "$TMP"),
               "shards": 64, "apparent_bytes": apparent, "exit_code": res.returncode,
               "cli_wall_s": {"median": round(statistics.median(times), 3), "max": round(max(times), 3),
                              "runs": [round(t, 3) for t in times]},
               "run_checks_in_process_s": round(in_process, 4)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = ROOT / "benchmarks" / "results" / "check_64_shards.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
