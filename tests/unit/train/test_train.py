"""Trainer: torchrun DDP equals one process, SIGKILL + resume equals uninterrupted, SIGTERM and Ctrl-C stop every
rank cleanly, and the export is what vLLM's EAGLE-3 loader reads."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from eagle3.config import TrainConfig
from eagle3.storage.lock import RunLock
from tests.helpers.training import AUX, FLAGS, losses, run_train

REPO = Path(__file__).resolve().parents[3]
def vals(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "val"]


def replay_every_2(stages: Path) -> list[str]:
    return ["--replay", (stages / "replay").read_text(), "--val-every", "2"]  # ranks replay their share of turns


@pytest.fixture(scope="module")
def two_ranks(stages, tmp_path_factory) -> Path:
    """2 processes x 1 row per step on one node, 4 steps, validated (with replay) at steps 2 and 4."""
    out = tmp_path_factory.mktemp("two-ranks") / "two"
    run_train(stages, out, "--max-steps", "4", "--grad-accum", "1", *replay_every_2(stages), nproc=2)
    return out


def test_two_processes_equal_one_with_same_global_batch(stages, two_ranks, tmp_path):
    run_train(stages, tmp_path / "one", "--max-steps", "4", "--grad-accum", "2", *replay_every_2(stages), nproc=1)
    va, vb = vals(tmp_path / "one"), vals(two_ranks)
    assert [v["step"] for v in va] == [2, 4] and all(v["replay_rounds"] > 0 for v in va)
    for x, y in zip(va, vb, strict=True):
        assert x["replay_rounds"] == y["replay_rounds"] and abs(x["replay_tau"] - y["replay_tau"]) <= 1e-9
    a, b = losses(tmp_path / "one"), losses(two_ranks)
    assert sorted(a) == [1, 2, 3, 4] and a[1] > 0
    for s in a:
        assert abs(a[s] - b[s]) <= 1e-6, (s, a[s], b[s])
    wa = load_file(tmp_path / "one" / "final" / "model.safetensors")
    wb = load_file(two_ranks / "final" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(stages: Path, out: Path, rank: int, *flags: str) -> subprocess.Popen:
    """`eagle3 train ... --node-rank RANK` (one node's command, as a user runs it on each host), logged beside out."""
    cmd = [sys.executable, "-m", "eagle3.cli", "train", "--hidden", str(stages / "hid"), "--verifier",
           str(stages / "ver"), "--out", str(out), *FLAGS, *flags, "--node-rank", str(rank)]
    with open(out.parent / f"node{rank}.log", "w") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def records(out: Path) -> list[dict]:
    """Every metrics record but its rate (the wall clock's)."""
    return [{k: v for k, v in json.loads(ln).items() if k != "tokens_per_s"}
            for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_equal_two_ranks_on_one_node(stages, two_ranks, tmp_path):
    """2 nodes x 1 process (two `eagle3 train --node-rank K` commands meeting at a rendezvous on this host) train
    what 2 processes on one node do: the same metrics records and final weights, bitwise. A node started again
    once the run is done ends at once instead of waiting at the rendezvous for peers that never come."""
    out = tmp_path / "nodes" / "train"
    out.parent.mkdir()
    nodes = ["--max-steps", "4", "--grad-accum", "1", *replay_every_2(stages), "--nnodes", "2",
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    procs = [node(stages, out, k, *nodes) for k in (0, 1)]
    for k, p in enumerate(procs):
        assert p.wait(timeout=600) == 0, (out.parent / f"node{k}.log").read_text()[-3000:]
    assert records(out) == records(two_ranks)
    final = "final/model.safetensors"
    assert (out / final).read_bytes() == (two_ranks / final).read_bytes()
    m = json.loads((out / "manifest.json").read_text())
    assert (m["config"]["nnodes"], m["config"]["nproc_per_node"]) == (2, 1) and "rdzv_endpoint" not in m["config"]
    again = node(stages, out, 1, *nodes[:-1], "127.0.0.1:1")  # nobody listens there: torchrun must not start
    # exit 0: a torchrun started against that endpoint could only fail (or wait out the rendezvous timeout)
    assert again.wait(timeout=120) == 0, (out.parent / "node1.log").read_text()[-3000:]
    assert json.loads((out / "manifest.json").read_text()) == m


def test_sigkill_mid_epoch_then_resume_matches_uninterrupted(stages, tmp_path):
    # with a replay set: each validation replays the val prompts' greedy answers, and picks the best by it; final/
    # holds the last step's weights all the same (export_step last)
    steps = ["--max-steps", "8", "--epochs", "5", "--replay", (stages / "replay").read_text(), "--val-every", "3",
             "--export-step", "last"]
    run_train(stages, tmp_path / "clean", *steps)
    p = run_train(stages, tmp_path / "killed", *steps, wait=False)
    deadline = time.time() + 300
    metrics = tmp_path / "killed" / "metrics.jsonl"
    while time.time() < deadline:  # kill once step 5 is logged: after the step-4 checkpoint
        if metrics.is_file() and max(losses(tmp_path / "killed"), default=0) >= 5:
            break
        assert p.poll() is None, p.stdout.read()[-3000:]
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not (tmp_path / "killed" / "final").exists()
    done = sorted((tmp_path / "killed" / "checkpoints").glob("step-*"))
    assert done and done[-1].name == "step-00000004"
    run_train(stages, tmp_path / "killed", *steps)
    assert losses(tmp_path / "killed") == losses(tmp_path / "clean")  # bitwise: same steps, same floats
    assert vals(tmp_path / "killed") == vals(tmp_path / "clean")  # replay tau included
    m = json.loads((tmp_path / "clean" / "manifest.json").read_text())
    assert m["best_metric"] == "replay_tau" and m["best_replay_tau"] >= 1.0
    assert m["best_step"] in [v["step"] for v in vals(tmp_path / "clean")]
    a = load_file(tmp_path / "clean" / "final" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from eagle3.model.draft import DraftConfig
    from eagle3.model.formats import export
    from eagle3.train.checkpoint import CKPT_DIR, load

    assert m["exported_step"] == 8
    last = load(tmp_path / "clean" / CKPT_DIR / "step-00000008")[0]
    export(last, DraftConfig(**m["draft_config"]), 2, tmp_path / "last", "vllm", verifier="tiny-llama")
    c = load_file(tmp_path / "last" / "model.safetensors")
    assert c.keys() == a.keys() and all(torch.equal(a[k], c[k]) for k in a)


# ---------------------------------------------------------------- a clean stop, on real signals
# SIGTERM or Ctrl-C (SIGINT) to `eagle3 train` with 2 ranks ends its whole process tree within 30 s, leaves no temp
# file and the lock free, says where it stopped, and the same command resumes to the uninterrupted run's result;
# a second Ctrl-C stops at once.
STOP_STEPS = ["--max-steps", "30", "--grad-accum", "1", "--nproc-per-node", "2"]


def train_cli(stages: Path, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flows.cli", "train", "--hidden", str(stages / "hid"), "--verifier",
           str(stages / "ver"), "--out", str(out), *FLAGS, *STOP_STEPS]
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen) -> str:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return out


def after_checkpoint(p: subprocess.Popen, out: Path) -> list[psutil.Process]:
    """Wait until the step-2 checkpoint is in place and step 3 is logged; the command's process tree then."""
    deadline = time.time() + 300
    while time.time() < deadline:
        if (out / "checkpoints" / "step-00000002").is_dir() and (out / "metrics.jsonl").is_file() \
                and max(losses(out), default=0) >= 3:
            break
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.05)
    tree = psutil.Process(p.pid).children(recursive=True)
    assert len(tree) >= 3, tree  # torchrun and its 2 ranks
    return tree


def alive(procs: list[psutil.Process], within_s: float = 10.0) -> list[psutil.Process]:
    """The processes of `procs` still running `within_s` after the call (a killed one takes a moment to go)."""
    psutil.wait_procs(procs, timeout=within_s)
    return [q for q in procs if q.is_running() and q.status() != psutil.STATUS_ZOMBIE]


def left_clean(out: Path) -> None:
    assert not list(out.rglob(".*.tmp")), list(out.rglob(".*.tmp"))
    assert not (out / "final").exists()
    with RunLock(out):  # free: taken at once
        pass


@pytest.fixture(scope="module")
def uninterrupted_cli(stages, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stop") / "clean"
    finish(train_cli(stages, out))
    return out


def test_sigterm_stops_every_rank_then_the_same_command_resumes(stages, uninterrupted_cli, tmp_path):
    out = tmp_path / "run"
    p = train_cli(stages, out)
    tree = after_checkpoint(p, out)
    p.send_signal(signal.SIGTERM)  # the parent alone, as `kill` or a scheduler sends it
    err = p.communicate(timeout=60)[1]
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert not (left := alive(tree)), left  # every rank gone with the parent
    line = err.strip().splitlines()[-1]
    assert line.startswith("eagle3 train: stopped by SIGTERM; the last file committed was ") and "resume" in line
    left_clean(out)
    finish(train_cli(stages, out))
    assert losses(out) == losses(uninterrupted_cli)  # bitwise: resumed from the last checkpoint
    m, ref = (json.loads((d / "manifest.json").read_text()) for d in (out, uninterrupted_cli))
    assert m["fingerprint"] == ref["fingerprint"]


def test_second_ctrl_c_stops_at_once_leaving_nothing_half_written(stages, uninterrupted_cli, tmp_path):
    out = tmp_path / "run"
    p = train_cli(stages, out)
    tree = after_checkpoint(p, out)
    p.send_signal(signal.SIGINT)  # the parent asks torchrun to stop and waits for it ...
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)  # ... and the second Ctrl-C kills the tree without waiting
    p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGINT
    assert not (left := alive(tree)), left  # killed, not left to the 20 s escalation
    left_clean(out)
    finish(train_cli(stages, out))
    assert losses(out) == losses(uninterrupted_cli)


# ---------------------------------------------------------------- export
def vllm_expected(c) -> dict[str, tuple[int, ...]]:
    """Names and shapes vLLM's llama_eagle3.py loads: `midlayer.` is mapped to `layers.0.`, names without
    `lm_head` get a `model.` prefix, q/k/v and gate/up are stacked by its loader, `d2t` becomes
    draft_id_to_target_id, `t2d` is skipped, and embed_tokens is optional (shared with the target)."""
    H, Ht, Hi, hd = c.hidden_size, c.target_hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    e = {
        "fc.weight": (H, 3 * Ht),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (Hi, H),
        "midlayer.mlp.up_proj.weight": (Hi, H),
        "midlayer.mlp.down_proj.weight": (H, Hi),
        "norm.weight": (H,),
        "lm_head.weight": (c.draft_vocab_size, H),
        "d2t": (c.draft_vocab_size,),
        "t2d": (c.vocab_size,),
    }
    if c.norm_before_fc:
        e["input_norm.weight"] = (3 * Ht,)  # newer vLLM reads norm_before_fc as this RMSNorm
    return e


@pytest.fixture(scope="module")
def trained(stages, tmp_path_factory):
    from eagle3.train.loop import train

    out = tmp_path_factory.mktemp("trained")
    cfg = TrainConfig(ttt_steps=2, pack_tokens=192, max_steps=3, val_every=2, ckpt_every=2, threads=1, lr=1e-3)
    m = train(cfg, stages / "hid", stages / "ver", out, progress=False)
    return out, m


def test_native_export_is_what_vllm_loads(trained, tiny_llama_dir):
    from eagle3.model.draft import DraftConfig

    out, m = trained
    cfg = json.loads((out / "final" / "config.json").read_text())
    target = json.loads((tiny_llama_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == target["vocab_size"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX
    for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual"):
        assert key in cfg
    c = DraftConfig(**m.draft_config)
    w = load_file(out / "final" / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in w.items()} == vllm_expected(c)
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert not any(k.startswith("model.") for k in w)


def test_independent_load_of_final_reproduces_trainer_logits(trained, stages):
    """Build a draft from final/config.json alone + the target embedding; its logits equal the
    best checkpoint's, bitwise."""
    from eagle3.model.draft import DraftConfig, Eagle3Draft
    from eagle3.storage.store import open_store
    from eagle3.train.checkpoint import BEST, CKPT_DIR, load

    out, m = trained
    cfg = json.loads((out / "final" / "config.json").read_text())
    c = DraftConfig(
        hidden_size=cfg["hidden_size"], target_hidden_size=cfg["target_hidden_size"],
        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"], intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"], rope_scaling=cfg["rope_scaling"],
        max_position_embeddings=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"],
        draft_vocab_size=cfg["draft_vocab_size"], aux_layer_ids=cfg["eagle_aux_hidden_state_layer_ids"],
        norm_before_fc=cfg["norm_before_fc"], norm_output=cfg["norm_output"],
        norm_before_residual=cfg["norm_before_residual"],
    )
    ver = load_file(stages / "ver" / "verifier.safetensors")
    mine = Eagle3Draft(c)
    missing, unexpected = mine.load_state_dict(load_file(out / "final" / "model.safetensors"), strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected
    mine.embed_tokens.weight.data.copy_(ver["embed_tokens"])
    ref = Eagle3Draft(c)
    ref.load_state_dict(load(out / CKPT_DIR / BEST)[0])
    s = open_store(stages / "hid", "val")[0]
    ids, aux = s["input_ids"].long()[None], s["aux_hidden_states"].float()[None]
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        a = mine.ttt_forward(ids, aux, pos, steps=2)
        b = ref.ttt_forward(ids, aux, pos, steps=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert m.best_step in (2, 3) and m.best_sim_tau >= 1.0 and m.exported_step == m.best_step


def test_speculators_export_layout(trained, tmp_path):
    from eagle3.model.draft import DraftConfig
    from eagle3.model.formats import export
    from eagle3.train.checkpoint import BEST, CKPT_DIR, load

    out, m = trained
    c = DraftConfig(**m.draft_config)
    export(load(out / CKPT_DIR / BEST)[0], c, 2, tmp_path / "spec", "speculators", verifier="tiny-llama")
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "tiny-llama"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    w = load_file(tmp_path / "spec" / "model.safetensors")
    native = {k.replace("midlayer.", "layers.0."): v for k, v in vllm_expected(c).items()}
    assert {k: tuple(v.shape) for k, v in w.items()} == native


def test_warm_start_loads_weights_and_keeps_the_vocab(trained, stages, tmp_path):
    from eagle3.storage.manifests import HiddenStates
    from eagle3.train.build import build_draft
    from eagle3.train.checkpoint import BEST, CKPT_DIR

    out, _ = trained
    cfg = TrainConfig(ttt_steps=2, pack_tokens=192, threads=1, init_from=str(out / "final"))
    d = build_draft(cfg, HiddenStates.read(stages / "hid"), stages / "ver")
    best = load_file(out / CKPT_DIR / BEST / "model.safetensors")
    assert all(torch.equal(d.state_dict()[k], best[k]) for k in best if k != "embed_tokens.weight")
    bad = tmp_path / "other"
    bad.mkdir()
    w = load_file(out / "final" / "model.safetensors")
    w["d2t"] = w["d2t"].roll(1)
    from safetensors.torch import save_file

    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="another draft vocab"):
        build_draft(cfg.model_copy(update={"init_from": str(bad)}), HiddenStates.read(stages / "hid"), stages / "ver")


def test_mismatched_checkpoint_is_refused(trained, stages):
    from eagle3.train.loop import train

    out, _ = trained
    (out / "manifest.json").unlink()
    with pytest.raises(ValueError, match="different config"):
        train(TrainConfig(ttt_steps=3, pack_tokens=192, max_steps=3, threads=1), stages / "hid", stages / "ver",
              out, progress=False)


def test_top_cache_equals_recomputing(stages):
    from eagle3.storage.store import open_store
    from eagle3.train.data import collate
    from eagle3.train.loss import TargetHead, scored
    from eagle3.train.validate import TopCache

    head = TargetHead.from_verifier(stages / "ver")
    store = open_store(stages / "hid", "train")
    cache = TopCache()
    idx = [3, 0, 5]
    batch = collate(store, idx, 192)
    ref_logits, full = head(batch["final"])
    need = scored(batch["loss_mask"], batch["doc"])  # the argmax only where a loss reads it, -1 elsewhere
    assert 0 < need.sum() < need.numel()
    ref_top = torch.where(need, full, -1)
    for _ in range(2):  # a miss fills the cache, a hit reads it
        logits, top = cache(head, batch, "train", idx)
        assert torch.equal(logits, ref_logits) and torch.equal(top.long(), ref_top)
    assert sorted(cache.top) == [("train", 0), ("train", 3), ("train", 5)]
    other = collate(store, [5, 3], 192)  # cached samples in another pack order
    assert torch.equal(cache(head, other, "train", [5, 3])[1].long(),
                       torch.where(scored(other["loss_mask"], other["doc"]), head(other["final"])[1], -1))


def test_bf16_compute_tracks_fp32_on_a_fixed_batch(stages):
    """train.precision bf16 on the CPU: one training pass over a fixed batch under bf16 autocast against fp32, from
    the same weights: the loss within 1%, every gradient within cosine 0.99 of fp32's, top-1 agreement equal to
    one position in a hundred; the parameters (and so the optimizer state) stay fp32."""
    from eagle3.runtime.floats import autocast, resolve_precision
    from eagle3.storage.manifests import HiddenStates
    from eagle3.storage.store import open_store
    from eagle3.train.build import build_draft
    from eagle3.train.data import collate
    from eagle3.train.loop import TTT
    from eagle3.train.loss import TargetHead, step_weights
    from eagle3.train.validate import TopCache, row_pass

    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == "fp32" and resolve_precision("bf16", cpu) == "bf16"
    cfg = TrainConfig(ttt_steps=2, pack_tokens=192)
    torch.manual_seed(0)
    draft = build_draft(cfg, HiddenStates.read(stages / "hid"), stages / "ver")
    model = TTT(draft, 2, cfg.attn_block, step_weights(2, cfg.step_decay))
    head, store, idx = TargetHead.from_verifier(stages / "ver"), open_store(stages / "hid", "train"), [0, 1, 2]
    batch = collate(store, idx, 192)
    runs = {}
    for precision in ("fp32", "bf16"):
        model.zero_grad(set_to_none=True)
        out = row_pass(model, TopCache()(head, batch, "train", idx), batch, autocast(precision, cpu))
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        runs[precision] = out, grads
    (ref, g32), (low, g16) = runs["fp32"], runs["bf16"]
    assert low.loss.item() != ref.loss.item()  # the matmuls did run in bf16
    assert abs(low.loss.item() - ref.loss.item()) <= 0.01 * abs(ref.loss.item())
    assert low.loss.dtype == torch.float32 and all(p.dtype == torch.float32 for p in model.parameters())
    for n, g in g32.items():
        assert g16[n].dtype == torch.float32
        assert torch.nn.functional.cosine_similarity(g.flatten(), g16[n].flatten(), dim=0) > 0.99, n
    for a, b, c in zip(ref.correct, low.correct, ref.kl_count, strict=True):
        assert abs(a - b) <= max(1, c // 100)


def test_init_levers_start_from_the_target_and_train_only_what_they_say(stages, tmp_path):
    """norm_init target: the draft's final norm is the target's; zero_init_residual: the layer starts as the identity
    on its residual; zero_aux: fc stays exactly zero through training (so does a head at head_lr_scale 0), and the
    export serves that same function; head_lr_scale 0.25: lm_head's group gets a quarter of the lr."""
    import shutil

    from safetensors.torch import load_file, save_file

    from eagle3.storage.manifests import HiddenStates
    from eagle3.train.build import build_draft
    from eagle3.train.loop import train
    from eagle3.train.optim import param_groups

    ver = shutil.copytree(stages / "ver", tmp_path / "ver")  # the tiny target's final norm is all ones: make it not
    tensors = load_file(ver / "verifier.safetensors")
    tensors["norm"] = torch.linspace(0.5, 2.0, tensors["norm"].numel())
    save_file(tensors, ver / "verifier.safetensors")
    norm, head = tensors["norm"], tensors["lm_head_draft"]
    cfg = TrainConfig(ttt_steps=2, pack_tokens=192, max_steps=3, threads=1, warmup_steps=0, replay_prompts=0,
                      norm_init="target", zero_init_residual=True, zero_aux=True, head_lr_scale=0.0)
    d = build_draft(cfg, HiddenStates.read(stages / "hid"), ver)
    assert torch.equal(d.norm.weight, norm)
    assert torch.equal(build_draft(cfg.model_copy(update={"norm_init": "ones"}), HiddenStates.read(stages / "hid"),
                                   ver).norm.weight, torch.ones_like(norm))
    r = torch.randn(1, 5, d.config.hidden_size)
    attn = torch.randn(1, d.config.num_attention_heads, 5, d.config.head_dim)
    assert torch.equal(d.midlayer.finish(attn, r), r)  # o_proj and down_proj at zero
    assert not d.fc.weight.requires_grad and not d.lm_head.weight.requires_grad

    train(cfg, stages / "hid", stages / "ver", tmp_path / "t", progress=False)
    w = load_file(tmp_path / "t" / "final" / "model.safetensors")
    assert not w["fc.weight"].any() and torch.equal(w["lm_head.weight"], head)
    assert not torch.equal(w["midlayer.mlp.down_proj.weight"], torch.zeros_like(w["midlayer.mlp.down_proj.weight"]))

    quarter = cfg.model_copy(update={"head_lr_scale": 0.25, "zero_aux": False, "lr": 2e-3})
    d = build_draft(quarter, HiddenStates.read(stages / "hid"), stages / "ver")
    params = [p for p in d.parameters() if p.requires_grad]
    body, lm = param_groups(d, params, quarter)
    assert lm["params"] == [d.lm_head.weight] and lm["lr"] == 5e-4 and "lr" not in body
    assert len(body["params"]) == len(params) - 1


def test_muon_resumes_equal_to_an_uninterrupted_run(stages, tmp_path):
    """optimizer muon: Muon on the 2-D hidden weights, AdamW on norms and lm_head, one schedule over both. A run
    put back to its step-4 checkpoint (as a kill after it leaves it) resumes both optimizers' state from it: the
    losses and the weights equal the uninterrupted run's bit for bit."""
    import shutil

    from eagle3.train.loop import train

    cfg = TrainConfig(ttt_steps=2, pack_tokens=192, max_steps=8, threads=1, warmup_steps=1, ckpt_every=2, keep_last=4,
                      val_every=1000, replay_prompts=0, optimizer="muon", lr=2e-3, log_every=1)
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    train(cfg, stages / "hid", stages / "ver", clean, progress=False)
    state = torch.load(clean / "checkpoints" / "step-00000004" / "state.pt", weights_only=True)
    assert set(state["optimizer"]) == {"muon", "adamw"} and state["optimizer"]["muon"]["state"]
    shutil.copytree(clean, resumed)
    for d in ("final", "checkpoints/step-00000006", "checkpoints/step-00000008", "checkpoints/best"):
        shutil.rmtree(resumed / d, ignore_errors=True)
    (resumed / "manifest.json").unlink()
    train(cfg, stages / "hid", stages / "ver", resumed, progress=False)
    assert losses(resumed) == losses(clean) and sorted(losses(clean)) == list(range(1, 9))
    a, b = (load_file(d / "final" / "model.safetensors") for d in (clean, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="muon runs under DDP only"):
        TrainConfig(optimizer="muon", fsdp=True)
