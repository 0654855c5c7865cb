"""Trainer: a tiny drafter overfits, a killed run resumes on the same loss curve, DDP(2) = 1 process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from conftest import write_conversations
from draftsmith.capture.local import capture
from draftsmith.errors import DraftsmithError
from draftsmith.train.settings import TrainConfig
from draftsmith.train.trainer import Trainer

CLI = [sys.executable, "-m", "draftsmith.cli"]


@pytest.fixture(scope="module")
def store(tiny_target, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train_store")
    conv = write_conversations(root / "conv.jsonl", n=16)
    capture(conv, root / "store", target=str(tiny_target), shard_tokens=300)
    return root / "store"


def losses(out: Path) -> dict[int, float]:
    """Last logged loss per step (a resumed run re-logs the steps after its checkpoint)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "eval" not in r}


def train_args(store: Path, out: Path, **kw) -> list[str]:
    args = {"store": store, "out": out, "lr": "3e-3", "batch-tokens": "256", "draft-vocab-size": "128", "ttt-steps": "3",
            "eval-fraction": "0", "log-every": "1", "quiet": None, **kw}
    flat = []
    for k, v in args.items():
        flat += [f"--{k}"] + ([str(v)] if v is not None else [])
    return flat


def test_tiny_drafter_overfits_step0_accuracy_to_one(tiny_target, tmp_path):
    conv = write_conversations(tmp_path / "conv.jsonl", n=4)
    capture(conv, tmp_path / "store", target=str(tiny_target))
    # The full vocabulary as draft vocabulary: every target argmax is reachable, so accuracy can reach 1.
    trainer = Trainer(TrainConfig(out=str(tmp_path / "run"), store=str(tmp_path / "store"), lr=1e-2, min_lr_ratio=0.05,
                                  warmup_ratio=0.0, max_steps=500, batch_tokens=2048, draft_vocab_size=300, ttt_steps=3,
                                  eval_fraction=0.0, eval_every=10**6, save_every=10**6, log_every=10**6))
    trainer.run(progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "acc" in r]
    assert train[0]["acc"][0] < 0.5, "the drafter started out already right; the test proves nothing"
    assert train[-1]["acc"][0] >= 0.99, train[-1]
    assert train[-1]["loss"] < train[0]["loss"] / 2


def test_killed_run_resumes_on_the_same_loss_curve(store, tmp_path):
    """kill -9 after the step-4 checkpoint, rerun: the same 12 losses. Packed (the default) into two rows of 128
    tokens per micro-batch, several conversations per row: the packing plan is a pure function of (seed, epoch)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    settings = {"max-steps": "12", "save-every": "4", "pack": None, "row-tokens": "128"}
    r = subprocess.run([*CLI, "train", *train_args(store, straight, **settings)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "packed rows of 128 tokens" in r.stdout
    proc = subprocess.Popen([*CLI, "train", *train_args(store, killed, **settings)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and not (latest.exists() and latest.read_text().strip() == "step-000004"):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "drafter").exists(), "the run finished before the kill; the test proves nothing"
    r = subprocess.run([*CLI, "train", *train_args(store, killed, **settings)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "resumed at step" in r.stdout
    a, b = losses(straight), losses(killed)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in range(1, 13):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    # Exact: the same process settings recompute the same plan, the same packed rows and the same floats.
    assert b == a, {s: (a[s], b[s]) for s in a if a[s] != b[s]}


@pytest.mark.parametrize("parallel, pack", [("ddp", "pack"), ("fsdp", "pack"), ("ddp", "no-pack")])
def test_two_processes_match_one_process_with_the_same_global_batch(store, tmp_path, parallel, pack):
    """gloo DDP(2) / FSDP2(2) with grad_accum 1 vs 1 process with grad_accum 2: the same micro-batches per step,
    packed (two rows of 128 tokens, several conversations each) or one conversation per row.

    Tolerance: fp32 gradients summed in a different order (all-reduce or reduce-scatter vs accumulation)
    differ by ~1e-7 relative per step; over 6 AdamW steps the losses agree to ~1e-5, far below the change
    one step makes. The exported drafters (gathered from the shards under FSDP) agree to the same order.
    """
    one, two = tmp_path / "one", tmp_path / "two"
    packing = {pack: None, "row-tokens": "128"}
    r = subprocess.run([*CLI, "train", *train_args(store, one, **{"max-steps": "6", "grad-accum": "2", **packing})],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(29500 + os.getpid() % 1000), "-m", "draftsmith.cli", "train",
                        *train_args(store, two, **{"max-steps": "6", "grad-accum": "1", "parallel": parallel, **packing})],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world 2" in r.stdout
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 6
    assert a[6] < a[1], "training did not move the loss; parity would be vacuous"
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), (step, a[step], b[step])
    from safetensors.torch import load_file

    wa, wb = load_file(one / "drafter" / "model.safetensors"), load_file(two / "drafter" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key].shape == wb[key].shape, key
        assert torch.allclose(wa[key], wb[key], rtol=1e-3, atol=1e-5), key


def test_online_training_sees_the_same_features_as_the_store(tiny_target, tmp_path):
    """Online (target in process) and offline (from the store) give the same first loss; the store keeps
    bf16 features, so they agree to bf16 precision, not bit for bit."""
    conv = write_conversations(tmp_path / "conv.jsonl", n=8)
    capture(conv, tmp_path / "store", target=str(tiny_target))
    common = dict(lr=1e-3, max_steps=2, batch_tokens=1024, draft_vocab_size=128, ttt_steps=3, eval_fraction=0.0,
                  eval_every=10**6, save_every=10**6, log_every=10**6)
    Trainer(TrainConfig(out=str(tmp_path / "off"), store=str(tmp_path / "store"), **common)).run(progress=False)
    Trainer(TrainConfig(out=str(tmp_path / "on"), conversations=str(conv), target=str(tiny_target), **common)).run(progress=False)
    off, on = losses(tmp_path / "off"), losses(tmp_path / "on")
    assert on[1] == pytest.approx(off[1], rel=2e-2)
    assert (tmp_path / "on" / "drafter" / "model.safetensors").exists()


def test_every_step_of_every_epoch_gets_its_micro_batches():
    """Regression (H200 run, 2026-11-30): epoch 0 fixes the steps per epoch; a later epoch's shuffle packed
    into fewer micro-batches, its last step got none and train_step crashed. Steps now wrap around."""
    import random

    from draftsmith.train.packing import micro_batches, rank_micro_batches

    random.seed(0)
    lengths = [random.randint(20, 900) for _ in range(120)]
    plans = [micro_batches(list(range(120)), lengths, 2048, seed=0, epoch=e) for e in range(4)]
    assert min(len(p) for p in plans[1:]) < len(plans[0])  # the premise: a later epoch packs tighter
    for world, accum in ((1, 1), (2, 1), (2, 3)):
        steps_per_epoch = len(plans[0]) // (world * accum)
        for plan in plans:
            for offset in range(steps_per_epoch):
                per_rank = [rank_micro_batches(plan, offset, world, accum, r) for r in range(world)]
                assert all(len(m) == accum and all(m) for m in per_rank)
            # within an epoch, no micro-batch repeats until the plan is used up
            used = [tuple(mb) for o in range(steps_per_epoch) for r in range(world)
                    for mb in rank_micro_batches(plan, o, world, accum, r)]
            assert len(set(used)) == min(len(used), len(plan))


def test_turn_pieces_end_at_assistant_turn_ends_and_fit_the_row():
    from draftsmith.train.packing import turn_pieces

    mask = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0])
    assert turn_pieces(mask, 6) == [(0, 4), (4, 9)]  # the tail (9, 12) has no supervised token: dropped
    assert turn_pieces(mask, 3) == [(0, 3), (3, 4), (4, 7), (7, 9)]  # no turn end fits: cut at the row length
    assert turn_pieces(mask, 12) == [(0, 12)]


def test_pack_plan_places_every_piece_once_in_full_rows_of_one_shape():
    import random

    from draftsmith.train.packing import pack_plan

    random.seed(0)
    pieces = [(k, 0, random.randint(20, 1000)) for k in range(300)]
    plans = [pack_plan(pieces, 1024, 3, seed=0, epoch=e) for e in range(2)]
    for plan in plans:
        assert all(len(mb) == 3 for mb in plan)
        rows = [row for mb in plan for row in mb]
        assert all(sum(e - s for _, s, e in row) <= 1024 for row in rows)
        assert sorted(seg for row in rows for seg in row) == sorted(pieces)
        fill = sum(e - s for _, s, e in pieces) / (1024 * sum(1 for row in rows if row))
        assert fill > 0.95, f"rows only {fill:.0%} full"
    assert plans[0] == pack_plan(pieces, 1024, 3, seed=0, epoch=0) and plans[0] != plans[1]


def test_pack_plan_steps_do_not_cycle_from_long_to_short_documents():
    """Best-fit longest-first fills a window's first rows with its longest pieces: the plan must not hand them
    out in that order (consecutive steps would cycle from long to short documents every window)."""
    import random

    from draftsmith.train.packing import PACK_WINDOW, pack_plan

    random.seed(1)
    pieces = [(k, 0, random.randint(20, 1000)) for k in range(4 * PACK_WINDOW)]
    plan = pack_plan(pieces, 1024, 1, seed=0, epoch=0)
    mean = torch.tensor([sum(e - s for _, s, e in mb[0]) / max(len(mb[0]), 1) for mb in plan], dtype=torch.float64)
    # Unshuffled, each window's mean piece length falls from row to row: consecutive steps correlate strongly.
    lag1 = torch.corrcoef(torch.stack([mean[:-1], mean[1:]]))[0, 1]
    assert abs(float(lag1)) < 0.3, f"consecutive steps' document lengths correlate: {float(lag1):.2f}"
    assert mean.std() > 50  # the rows do differ: the test can tell an order from a shuffle


def test_packed_micro_batches_keep_one_shape_and_every_supervised_token(store, tmp_path):
    """Static shapes: every micro-batch of every epoch, train and eval, is (batch_tokens // row_tokens, row_tokens),
    and packing (long samples split at turn ends) loses no supervised token."""
    trainer = Trainer(TrainConfig(out=str(tmp_path / "run"), store=str(store), batch_tokens=128, row_tokens=64,
                                  draft_vocab_size=128, eval_fraction=0.2))
    assert max(trainer.data.lengths) > 64, "no sample needs splitting; the test proves less than it says"
    supervised = 0
    for train, epoch in ((True, 0), (True, 1), (False, 0)):
        for mb in trainer.plan(train, epoch):
            batch = trainer.load(mb)
            assert batch.input_ids.shape == (2, 64) and batch.documents.shape == (2, 64)
            supervised += int(batch.loss_mask.sum()) if epoch == 0 else 0
    expected = sum(int(trainer.data.loss_mask(k).sum()) for k in range(len(trainer.data)))
    assert supervised == expected


def test_the_loop_reads_each_step_behind_the_next_and_logs_what_a_waited_step_gives(store, tmp_path):
    """The loop queues step n+1 before it reads step n's statistics (no CPU-GPU sync between steps). The log it
    writes is the one a waited-for step gives: each step once, in order, every number equal to `train_step()`
    called step by step, and an eval record after the step it follows."""
    def config(out):
        return TrainConfig(out=str(tmp_path / out), store=str(store), lr=3e-3, batch_tokens=256, draft_vocab_size=128,
                           ttt_steps=3, eval_fraction=0.2, max_steps=7, eval_every=3, save_every=2, log_every=10**6,
                           clip=1e6)  # no clipping: the gradients' norm after the step is the logged one

    Trainer(config("loop")).run(progress=False)
    records = [json.loads(line) for line in (tmp_path / "loop" / "metrics.jsonl").read_text().splitlines()]
    order = [("eval" if "eval" in r else "first" if "first_step_s" in r else "step", r["step"]) for r in records]
    assert order == [("first", 1), ("step", 1), ("step", 2), ("step", 3), ("eval", 3), ("step", 4), ("step", 5),
                     ("step", 6), ("eval", 6), ("step", 7), ("eval", 7)], order

    waited = Trainer(config("waited"))
    steps = []
    for _ in range(7):
        steps.append(waited.train_step())
        waited.step += 1
        # Each number is read from the right slot of the step's statistics: the gradients have the logged norm,
        # the loss is the decayed sum of the per-step losses, and prompts make real tokens outnumber supervised.
        grads = [p.grad.norm() for p in waited.drafter.parameters() if p.grad is not None]
        r = steps[-1]
        assert float(torch.stack(grads).norm()) == pytest.approx(r["grad_norm"], rel=1e-4)
        decayed = sum(waited.cfg.step_loss_decay ** i * x for i, x in enumerate(r["loss_per_step"]))
        assert r["loss"] == pytest.approx(decayed, rel=1e-5)
        assert 0 < r["supervised_tokens"] < r["real_tokens"] <= r["tokens"]
    waited.close()
    logged = [r for r in records if "loss" in r and "eval" not in r]
    assert [r["step"] for r in steps] == [r["step"] for r in logged] == list(range(1, 8))
    for a, b in zip(steps, logged):
        for key in ("loss", "loss_per_step", "acc", "grad_norm", "lr", "real_tokens", "supervised_tokens", "tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), (a["step"], key, a[key], b[key])
    assert logged[0]["grad_norm"] > 0 and logged[-1]["loss"] < logged[0]["loss"], "nothing trained; proves little"


def tiny_unroll_inputs(packed: bool):
    """A float64 tiny drafter (the normed recipe's norms) with its draft vocabulary, the target head, and one batch:
    documents packed into two rows of 256 tokens (a multiple of FlexAttention's block), or one padded per row."""
    from test_drafter import packed_and_unpacked, random_documents, tiny_config

    from draftsmith.model.eagle3 import Eagle3Drafter
    from draftsmith.model.vocab import build_draft_vocab

    torch.manual_seed(0)
    drafter = Eagle3Drafter(tiny_config(norm_before_fc=True, norm_before_residual=True)).double()
    vocab = build_draft_vocab(torch.arange(96, 0, -1), 48)
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    head = torch.randn(96, 40, dtype=torch.float64)
    docs = random_documents([60, 90, 40, 120, 100])
    for d in docs:
        d[4].copy_((d[3] @ head.T).argmax(-1))
    (ids, mask, aux, last, argmax), batch = packed_and_unpacked(
        docs, [[(1, 0, 90), (0, 0, 60), (2, 0, 40)], [(3, 0, 120), (4, 0, 100)]], row_tokens=256)
    if packed:
        return drafter, head, (batch.aux, batch.input_ids, batch.loss_mask, batch.last, head), \
            dict(t_argmax=batch.target_argmax, documents=batch.documents)
    return drafter, head, (aux, ids, mask, last, head), dict(t_argmax=argmax)


def unroll_and_grads(drafter, args, kwargs, grad: bool = True):
    from draftsmith.model.eagle3 import ttt_forward

    with torch.set_grad_enabled(grad):
        out = ttt_forward(drafter, *args, steps=4, **kwargs)
    params = [p for p in drafter.parameters() if p.requires_grad]
    return out, torch.autograd.grad(out.loss, params) if grad else []


@pytest.mark.parametrize("packed", [False, True])
def test_the_compiled_forward_is_one_graph_that_equals_the_eager_unroll(packed):
    """`compile_for_training` compiles the whole forward, target softmax, masks and loss included, so that no
    eager kernel runs around it: it must trace as one graph (fullgraph: a graph break raises) and
    compute what the eager unroll does, loss, statistics and every gradient (float64; the aot_eager backend runs
    the traced graph's own ops, so this checks the capture, not inductor's kernels: tests/test_drafter.py and
    tests/test_gpu.py run those)."""
    from draftsmith.model.eagle3 import ttt_unroll

    drafter, _, args, kwargs = tiny_unroll_inputs(packed)
    eager, eager_grads = unroll_and_grads(drafter, args, kwargs)
    drafter.ttt_unroll = torch.compile(ttt_unroll, backend="aot_eager", fullgraph=True)
    out, grads = unroll_and_grads(drafter, args, kwargs)
    assert eager.loss.item() > 0 and any(g.abs().max() > 0 for g in grads), "nothing to compare"
    torch.testing.assert_close(out.loss, eager.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.loss_sum, eager.loss_sum, rtol=1e-12, atol=1e-12)
    assert torch.equal(out.correct, eager.correct) and torch.equal(out.valid, eager.valid)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_cuda_paths_block_mask_and_flex_attention_trace_inside_the_compiled_forward(monkeypatch):
    """On CUDA the compiled forward also builds the packed rows' FlexAttention block mask (`document_block_mask`)
    and attends through it. Here on CPU, with that mask swapped in for the dense one, the forward still traces as
    one graph and gives the dense mask's loss and statistics (forward only: FlexAttention has no CPU backward)."""
    import draftsmith.model.eagle3 as drafter_module
    from draftsmith.model.eagle3 import ttt_unroll
    from draftsmith.model.kernels import document_block_mask

    drafter, _, args, kwargs = tiny_unroll_inputs(packed=True)
    dense, _ = unroll_and_grads(drafter, args, kwargs, grad=False)
    monkeypatch.setattr(drafter_module, "document_mask", document_block_mask)
    drafter.ttt_unroll = torch.compile(ttt_unroll, backend="aot_eager", fullgraph=True)
    block, _ = unroll_and_grads(drafter, args, kwargs, grad=False)
    torch.testing.assert_close(block.loss, dense.loss, rtol=1e-10, atol=0)
    torch.testing.assert_close(block.loss_sum, dense.loss_sum, rtol=1e-10, atol=1e-12)
    assert torch.equal(block.correct, dense.correct)


def test_one_micro_batch_normalised_by_its_own_counts_is_the_explicit_global_denominator():
    """One process, one micro-batch: `launch_step` lets the forward count the supervised positions itself
    (denominators None) instead of passing the global counts; loss and gradients are the same, exactly."""
    from draftsmith.model.eagle3 import step_masks

    drafter, _, args, kwargs = tiny_unroll_inputs(packed=True)
    own, own_grads = unroll_and_grads(drafter, args, kwargs)
    denom = step_masks(args[2], 4, kwargs["documents"]).sum(dim=(1, 2)).float()
    given, given_grads = unroll_and_grads(drafter, args, {**kwargs, "denominators": denom})
    assert torch.equal(own.loss, given.loss) and torch.equal(own.loss_sum, given.loss_sum)
    assert all(torch.equal(a, b) for a, b in zip(own_grads, given_grads))


def test_a_compiled_trainer_logs_what_the_eager_one_does(store, tmp_path, monkeypatch):
    """`train --compile` on the real Trainer (compile_for_training, the static target head, the step's statistics
    read from the compiled forward's outputs, evaluation under no_grad): each step's record and the held-back
    result equal the eager run's. torch.compile runs with the aot_eager backend here (inductor on CPU would take
    minutes), fullgraph so that a graph break fails."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", fullgraph=True))

    def run(name: str, **kw) -> tuple[list[dict], dict]:
        cfg = TrainConfig(out=str(tmp_path / name), store=str(store), lr=3e-3, batch_tokens=256, row_tokens=128,
                          draft_vocab_size=128, ttt_steps=3, eval_fraction=0.2, max_steps=4, eval_every=10**6,
                          save_every=10**6, log_every=10**6, **kw)
        with Trainer(cfg) as trainer:
            records = []
            for _ in range(cfg.max_steps):
                records.append(trainer.train_step())
                trainer.step += 1
            return records, asdict(trainer.evaluate())

    (eager, eager_eval), (compiled, compiled_eval) = run("eager"), run("compiled", compile=True)
    assert eager[-1]["loss"] < eager[0]["loss"], "nothing trained; proves little"
    for a, b in zip(eager, compiled):
        for key in ("loss", "loss_per_step", "acc", "grad_norm", "real_tokens", "supervised_tokens", "tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key, a[key], b[key])
    for key in ("acc", "loss", "tau"):
        assert compiled_eval[key] == pytest.approx(eager_eval[key], rel=1e-5), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_trainer_with_cuda_graphs_follows_the_eager_one_on_cuda_across_evaluations(store, tmp_path):
    """`train --compile --cuda-graphs` on the real Trainer on CUDA (inductor, CUDA graph trees, bf16 autocast):
    training steps, a held-back evaluation under no_grad (its own graphs), then more training steps replaying
    the training graphs again; each step's record and both evaluations follow the eager run's within bf16
    rounding. A replay reading memory another graph overwrote would be far off (or raise)."""
    torch._dynamo.reset()

    def run(name: str, **kw) -> tuple[list[dict], list[dict]]:
        cfg = TrainConfig(out=str(tmp_path / name), store=str(store), lr=3e-3, batch_tokens=256, row_tokens=128,
                          draft_vocab_size=128, ttt_steps=3, eval_fraction=0.2, max_steps=6, eval_every=10**6,
                          save_every=10**6, log_every=10**6, device="cuda", **kw)
        records, evals = [], []
        with Trainer(cfg) as trainer:
            for i in range(cfg.max_steps):
                records.append(trainer.train_step())
                trainer.step += 1
                if i in (2, 5):
                    evals.append(asdict(trainer.evaluate()))
        return records, evals

    (eager, eager_evals), (graphs, graph_evals) = run("eager"), run("graphs", compile=True, cuda_graphs=True)
    torch._dynamo.reset()
    assert eager[-1]["loss"] < eager[0]["loss"], "nothing trained; proves little"
    for a, b in zip(eager, graphs):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2), (a["step"], a["loss"], b["loss"])
        assert b["supervised_tokens"] == a["supervised_tokens"]
    for a, b in zip(eager_evals, graph_evals):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2) and b["tau"] == pytest.approx(a["tau"], rel=5e-2), (a, b)


def test_a_new_drafter_takes_speculators_norm_variants_and_the_learning_rate_default_follows_init_from(store,
                                                                                                      tmp_path):
    """--norm-before-fc / --norm-output / --norm-before-residual build a drafter that has them, trains its input
    norm and writes them where vLLM reads them; an unset lr is 1e-3 for a new drafter and 2e-4 with --init-from."""
    from draftsmith.train.settings import FINE_TUNE_LR, SCRATCH_LR

    cfg = dict(store=str(store), batch_tokens=256, draft_vocab_size=128, ttt_steps=2, eval_fraction=0.0, max_steps=3,
               eval_every=10**6, save_every=10**6, log_every=10**6)
    trainer = Trainer(TrainConfig(out=str(tmp_path / "norms"), norm_before_fc=True, norm_output=True,
                                  norm_before_residual=True, **cfg))
    c = trainer.drafter.config
    assert (c.norm_before_fc, c.norm_output, c.norm_before_residual) == (True, True, True)
    before = trainer.drafter.input_norm.weight.detach().clone()
    trainer.run(progress=False)
    assert not torch.equal(trainer.drafter.input_norm.weight.detach(), before), "the input norm was not trained"
    written = json.loads((tmp_path / "norms" / "drafter" / "config.json").read_text())
    assert written["norm_before_fc"] and written["eagle_config"]["norm_before_fc"] and written["norm_output"]
    assert json.loads((tmp_path / "norms" / "train_config.json").read_text())["peak_lr"] == SCRATCH_LR
    assert TrainConfig(out="o", init_from=str(tmp_path / "norms" / "drafter"), **cfg).peak_lr == FINE_TUNE_LR
    assert TrainConfig(out="o", lr=5e-4, init_from="smollm2", **cfg).peak_lr == 5e-4


def test_draft_head_starts_as_the_targets_rows_and_stays_frozen_when_asked(store, tmp_path):
    """--head-init target copies the target's lm_head rows of the draft vocabulary (draft-id order); random keeps
    nn.Linear's init with every other weight the same; --no-train-head leaves the head untouched by training."""
    cfg = dict(store=str(store), batch_tokens=256, draft_vocab_size=128, ttt_steps=2, eval_fraction=0.0, max_steps=3,
               lr=3e-3, eval_every=10**6, save_every=10**6, log_every=10**6)
    target = Trainer(TrainConfig(out=str(tmp_path / "target"), head_init="target", train_head=True, **cfg))
    rows = target.data.target_head()[torch.arange(128) + target.drafter.d2t.cpu()]
    assert torch.equal(target.drafter.lm_head.weight.detach().cpu(), rows.to(target.drafter.lm_head.weight.dtype))
    random = Trainer(TrainConfig(out=str(tmp_path / "random"), head_init="random", **cfg))
    assert not torch.allclose(random.drafter.lm_head.weight.detach().cpu(), rows, atol=1e-3)
    assert torch.equal(random.drafter.fc.weight, target.drafter.fc.weight)  # same seed: only the head differs

    frozen = Trainer(TrainConfig(out=str(tmp_path / "frozen"), head_init="target", train_head=False, **cfg))
    head, fc = frozen.drafter.lm_head.weight.detach().clone(), frozen.drafter.fc.weight.detach().clone()
    frozen.run(progress=False)
    assert torch.equal(frozen.drafter.lm_head.weight, head)
    assert not torch.equal(frozen.drafter.fc.weight, fc), "nothing trained; the test proves nothing"
    target.run(progress=False)
    assert not torch.equal(target.drafter.lm_head.weight.detach().cpu(), rows.to(head.dtype)), "a trained head moves"


def test_a_larger_draft_vocab_size_grows_the_starting_drafters_vocabulary(store, tmp_path):
    """With --init-from, a --draft-vocab-size above the start's keeps every starting token with its head row (at its
    new draft id), adds this data's most frequent other tokens with the target's head rows (a head started from the
    target's rows and frozen: scale 1), and keeps every other weight; the grown drafter trains, and what it writes
    loads back at the new size. A smaller size keeps the start's vocabulary."""
    from draftsmith.model.checkpoint import load_drafter

    cfg = dict(store=str(store), batch_tokens=256, ttt_steps=2, eval_fraction=0.0, max_steps=2, lr=3e-3,
               eval_every=10**6, save_every=10**6, log_every=10**6)
    Trainer(TrainConfig(out=str(tmp_path / "start"), draft_vocab_size=64, head_init="target", train_head=False,
                        **cfg)).run(progress=False)
    start = load_drafter(tmp_path / "start" / "drafter")
    trainer = Trainer(TrainConfig(out=str(tmp_path / "grown"), init_from=str(tmp_path / "start" / "drafter"),
                                  draft_vocab_size=128, **cfg))
    grown = trainer.drafter
    old_ids = (torch.arange(64) + start.d2t).tolist()
    new_ids = (torch.arange(128) + grown.d2t.cpu()).tolist()
    assert grown.config.draft_vocab_size == 128 and new_ids == sorted(set(new_ids)) and set(old_ids) <= set(new_ids)
    assert grown.t2d.sum().item() == 128 and grown.t2d[torch.tensor(new_ids)].all()
    head = grown.lm_head.weight.detach().cpu()
    for i, t in enumerate(old_ids):
        assert torch.equal(head[new_ids.index(t)], start.lm_head.weight[i].detach())
    added = [j for j, t in enumerate(new_ids) if t not in set(old_ids)]
    target_rows = trainer.data.target_head()[torch.tensor(new_ids)[added]]
    assert torch.allclose(head[added], target_rows, rtol=1e-5, atol=1e-6)
    counts = trainer.data.token_counts().to(torch.float64)
    others = counts.clone()
    others[torch.tensor(new_ids)] = -1.0
    assert counts[torch.tensor(new_ids)[added]].min() >= others.max(), "an added token is rarer than one left out"
    assert torch.equal(grown.fc.weight.detach().cpu(), start.fc.weight.detach())
    trainer.run(progress=False)
    written = load_drafter(tmp_path / "grown" / "drafter")
    assert written.config.draft_vocab_size == 128 and torch.equal(written.d2t, grown.d2t.cpu())
    kept = Trainer(TrainConfig(out=str(tmp_path / "kept"), init_from=str(tmp_path / "start" / "drafter"),
                               draft_vocab_size=32, **cfg))
    assert kept.drafter.config.draft_vocab_size == 64 and torch.equal(kept.drafter.d2t.cpu(), start.d2t)


def test_grow_draft_vocab_refuses_a_size_outside_the_start_and_the_target():
    from draftsmith.model.vocab import grow_draft_vocab

    d2t = torch.tensor([0, 1, 5])  # tokens 0, 2, 7 of a 10-token target
    counts = torch.tensor([0, 9, 0, 3, 3, 0, 0, 1, 0, 2])
    grown = grow_draft_vocab(d2t, counts, 5)
    assert (torch.arange(5) + grown.d2t).tolist() == [0, 1, 2, 3, 7]  # 3 beats 4 on a tie: the lower id
    assert grown.coverage == pytest.approx((0 + 9 + 0 + 3 + 1) / 18)
    for size in (2, 11):
        with pytest.raises(DraftsmithError, match="cannot grow the draft vocabulary"):
            grow_draft_vocab(d2t, counts, size)


def test_a_fine_tune_that_lowers_held_back_tau_writes_the_starting_drafter(store, tmp_path):
    """keep_start: the drafter written is the starting one, byte for byte in its weights, when fine-tuning lowers
    held-back simulated tau (lr 1.0 wrecks a trained drafter), and the fine-tuned one when it raises it (a trained
    drafter from an almost untrained one); --no-keep-start writes the fine-tuned one either way."""
    from safetensors.torch import load_file

    cfg = dict(store=str(store), batch_tokens=256, draft_vocab_size=128, ttt_steps=3, eval_fraction=0.25,
               warmup_ratio=0.0, eval_every=10**6, save_every=10**6, log_every=10**6)

    def train(name: str, **kw) -> tuple[dict, dict]:
        Trainer(TrainConfig(out=str(tmp_path / name), **{**cfg, **kw})).run(progress=False)
        drafter = tmp_path / name / "drafter"
        return load_file(str(drafter / "model.safetensors")), json.loads((drafter / "config.json").read_text())["draftsmith"]

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    raw, _ = train("raw", lr=1e-9, max_steps=1)  # almost the random initialisation
    trained, _ = train("trained", lr=3e-3, max_steps=40)
    wrecked, sel = train("wrecked", init_from=str(tmp_path / "trained" / "drafter"), lr=1.0, max_steps=3)
    assert sel["selection"]["kept"] == "starting"
    assert sel["selection"]["fine_tuned_tau"] < sel["selection"]["starting_tau"], sel
    assert same(wrecked, trained)
    assert sel["eval"]["tau"]["3"] == sel["selection"]["starting_tau"], "the config's eval is the written drafter's"
    starts = [json.loads(line) for line in (tmp_path / "wrecked" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in starts if r.get("starting_drafter")] == [0]

    forced, sel = train("forced", init_from=str(tmp_path / "trained" / "drafter"), lr=1.0, max_steps=3, keep_start=False)
    assert "selection" not in sel and not same(forced, trained)

    improved, sel = train("improved", init_from=str(tmp_path / "raw" / "drafter"), lr=3e-3, max_steps=40)
    assert sel["selection"]["kept"] == "fine-tuned"
    assert sel["selection"]["fine_tuned_tau"] > sel["selection"]["starting_tau"], sel
    assert not same(improved, raw)


def test_the_recipe_sets_a_new_drafters_norms_and_head_and_each_field_set_overrides_it(store, tmp_path):
    """--recipe auto trains the normed layout (the input norm and the normed residual, the target's head rows
    frozen, no normed output state); plain none of it; a
    field set wins over its recipe; --init-from keeps the starting drafter's norms and trains its head."""
    from draftsmith.train.settings import RECIPES, Layout

    cfg = dict(store=str(store), batch_tokens=256, draft_vocab_size=128, ttt_steps=2, eval_fraction=0.0, max_steps=2,
               eval_every=10**6, save_every=10**6, log_every=10**6)
    normed = Trainer(TrainConfig(out=str(tmp_path / "auto"), **cfg))
    c, head = normed.drafter.config, normed.drafter.lm_head.weight
    assert (c.norm_before_fc, c.norm_output, c.norm_before_residual, head.requires_grad) == (True, False, True, False)
    rows = normed.data.target_head()[torch.arange(128) + normed.drafter.d2t.cpu()]
    assert torch.equal(head.detach().cpu(), rows.to(head.dtype))
    normed.run(progress=False)
    written = json.loads((tmp_path / "auto" / "train_config.json").read_text())
    assert written["recipe"] == "auto" and written["layout"] == RECIPES["normed"]._asdict()

    plain = Trainer(TrainConfig(out=str(tmp_path / "plain"), recipe="plain", **cfg))
    c = plain.drafter.config
    assert (c.norm_before_fc, c.norm_output, c.norm_before_residual, plain.drafter.lm_head.weight.requires_grad) \
        == (False, False, False, True)
    assert TrainConfig(out="o", recipe="plain", norm_output=True, train_head=False, **cfg).layout() \
        == Layout(False, True, False, "random", False)
    start = normed.drafter.config
    assert TrainConfig(out="o", recipe="plain", init_from="x", **cfg).layout(start) == Layout(True, False, True, "init", True)
    with pytest.raises(DraftsmithError, match="unknown --recipe"):
        TrainConfig(out="o", recipe="speculators", **cfg)


def test_cuda_graphs_are_refused_without_a_compiled_step_at_one_shape():
    """CUDA graphs replay the compiled step at fixed shapes: asked for without --compile or with --no-pack, the
    config says which flag is missing instead of training eagerly without a word."""
    assert TrainConfig(out="o", store="s", compile=True, cuda_graphs=True).cuda_graphs
    with pytest.raises(DraftsmithError, match="--cuda-graphs with --no-compile, --pack") as e:
        TrainConfig(out="o", store="s", cuda_graphs=True)
    assert "add --compile" in str(e.value)
    with pytest.raises(DraftsmithError, match="--cuda-graphs with --compile, --no-pack"):
        TrainConfig(out="o", store="s", compile=True, cuda_graphs=True, pack=False)
    # the replays of two micro-batches share their output memory: the first one's gradients would be overwritten
    with pytest.raises(DraftsmithError, match="--cuda-graphs with --grad-accum 2") as e:
        TrainConfig(out="o", store="s", compile=True, cuda_graphs=True, grad_accum=2)
    assert "--batch-tokens 2x" in str(e.value)


def test_run_trains_the_normed_recipe_only_for_formats_whose_engines_compute_its_norms():
    from draftsmith.run.settings import RunConfig, apply_override
    from draftsmith.train.settings import recipe_for

    assert recipe_for("auto", ("vllm",)) == recipe_for("auto", ("vllm", "speculators")) == "normed"
    assert recipe_for("auto", ("vllm", "llamacpp")) == "normed"  # llama.cpp computes both of its norms
    assert recipe_for("auto", ("vllm", "sglang")) == recipe_for("auto", ("llamacpp", "sglang")) == "plain"
    assert recipe_for("normed", ("sglang",)) == "normed" and recipe_for("plain", ("vllm",)) == "plain"
    cfg = apply_override(RunConfig(), "export.formats=vllm,sglang")
    with pytest.raises(DraftsmithError, match="train.recipe: normed"):
        apply_override(cfg, "train.recipe=normed")
    assert apply_override(cfg, "train.recipe=plain").train.recipe == "plain"
