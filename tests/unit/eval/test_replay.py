"""Replay evaluation equals live chain decoding round by round, and reports what live reports."""
from __future__ import annotations

import json

import pytest
import torch

from eagle3.config import ExtractConfig, PrepareConfig, RegenConfig, TrainConfig
from eagle3.eval.decode import DraftProposer, Stats, TargetLM, speculative_generate
from eagle3.eval.prompts import Conversation, load_prompts
from eagle3.eval.replay import Turn, aux_states, bootstrap_ci, continuations, proposals, replay, walk
from eagle3.model.formats import load_draft
from eagle3.model.target import Target

pytestmark = pytest.mark.usefixtures("one_thread")
AUX = [1, 3, 4]
K, MAX_NEW = 3, 40


@pytest.fixture(scope="module")
def head(tmp_path_factory, tiny_llama_dir):
    """A draft that agrees with the tiny target often: trained on the target's own greedy answers."""
    from eagle3.extract import run_extract
    from eagle3.prepare import prepare
    from eagle3.regenerate.run import regenerate
    from eagle3.train.loop import train
    from eagle3.verifier import extract_verifier

    root = tmp_path_factory.mktemp("replay-head")
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread (OpenMP waits dominate on a shared CPU)
    regenerate(tiny_llama_dir, "sharegpt", root / "regen", RegenConfig(limit=24, max_new_tokens=64, batch_size=8))
    prepare(tiny_llama_dir, root / "prep",
            PrepareConfig(data=str(root / "regen" / "regenerated.jsonl"), max_len=256, draft_vocab=1024,
                          val_fraction=0.1), progress=False)
    run_extract(tiny_llama_dir, root / "prep", root / "hid", ExtractConfig(aux_layer_ids=AUX), show_progress=False)
    extract_verifier(tiny_llama_dir, root / "prep", root / "ver")
    cfg = TrainConfig(ttt_steps=3, max_steps=40, epochs=20, pack_tokens=256, lr=3e-3, warmup_steps=2, threads=1,
                      val_every=1000, ckpt_every=1000, log_every=1000)
    train(cfg, root / "hid", root / "ver", root / "train", progress=False)
    torch.set_num_threads(n)
    return root / "train" / "final"


@pytest.fixture(scope="module")
def setup(head, tiny_llama_dir, tmp_path_factory):
    t = Target.open(tiny_llama_dir)
    model = t.load_model(head=True, device="cpu")
    draft, _ = load_draft(head, tiny_llama_dir, model.get_input_embeddings().weight)
    convs = [Conversation("a", [{"role": "user", "content": "Name three colors."}], ["And three animals?"]),
             Conversation("b", [{"role": "user", "content": "What is 2+2?"}]),
             Conversation("c", [{"role": "user", "content": "Write a short poem about the sea."}], ["Shorter."])]
    return t, model, draft.eval(), convs, tmp_path_factory.mktemp("replay-cache")


def test_replay_equals_live_round_by_round(setup):
    t, model, draft, convs, cache = setup
    eos = t.stop_ids()
    turns, d, _ = continuations(t, model, convs, MAX_NEW, tail=8, cache=cache, batch_size=4)
    assert [(x.conv, x.turn) for x in turns] == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1)]
    aux, _ = aux_states(model.get_decoder(), turns, AUX, d)
    props = proposals(draft, turns, aux, K, MAX_NEW)
    live_target, proposer = TargetLM(model, AUX), DraftProposer(draft)
    total = disagree = accepted = 0
    for turn, p in zip(turns, props, strict=True):
        prompt = turn.ids[: turn.prompt_len]
        st = Stats(K)
        out = speculative_generate(live_target, proposer, prompt, K, MAX_NEW, eos, st)
        # the batched cache holds exactly the live (batch-1) greedy answer
        assert out == turn.ids[turn.prompt_len : turn.prompt_len + turn.answer_len]
        rounds = walk(turn, p, K, MAX_NEW, eos)
        total += len(st.rounds)
        disagree += sum(a != b for a, b in zip(rounds, st.rounds, strict=False)) + abs(len(rounds) - len(st.rounds))
        accepted += sum(st.rounds)
        assert rounds == st.rounds, (turn.conv, turn.turn)
    assert disagree == 0 and total >= 20
    assert 0 < accepted < K * total  # a head that is right often, and wrong sometimes: the test has teeth


def test_chains_at_the_rounds_equal_the_full_ttt_pass(setup):
    t, model, draft, convs, cache = setup
    turns, d, _ = continuations(t, model, convs, MAX_NEW, tail=8, cache=cache, batch_size=4)
    aux, _ = aux_states(model.get_decoder(), turns, AUX, d)
    for n, (tr, a) in enumerate(zip(turns, aux, strict=True)):
        ids = torch.tensor(tr.ids)[None]  # [1, L]
        a = a.float()[None]
        with torch.no_grad():
            full = draft.ttt_states(ids, a, torch.arange(ids.shape[1])[None], K)
        at = torch.rand(ids.shape[1], generator=torch.Generator().manual_seed(n)) < 0.3
        got = draft.ttt_states_at(ids, a, K, at)  # every chain carried through every step
        assert len(got) == K
        for f, (pos, g) in zip(full, got, strict=True):
            assert torch.equal(pos, at.nonzero()[:, 0])
            torch.testing.assert_close(g, f[0, pos], rtol=1e-5, atol=1e-5)
        # keep: a chain stops where it is told; the later steps run at the survivors only
        drop = lambda j, pos, st: pos % 2 == 0  # noqa: E731
        got = draft.ttt_states_at(ids, a, K, at, drop)
        for j, (f, (pos, g)) in enumerate(zip(full, got, strict=True)):
            want = at.nonzero()[:, 0]
            want = want[want % 2 == 0] if j else want
            assert torch.equal(pos, want)
            torch.testing.assert_close(g, f[0, pos], rtol=1e-5, atol=1e-5)


def test_replay_report_matches_live_measure_and_caches(setup):
    from eagle3.eval.decode import measure

    t, model, draft, convs, cache = setup
    eos = t.stop_ids()
    turns, d, gen_s = continuations(t, model, convs, MAX_NEW, tail=8, cache=cache, batch_size=4)
    assert gen_s == 0.0  # the first test built it
    aux, aux_s = aux_states(model.get_decoder(), turns, AUX, d)
    assert aux_s == 0.0
    r = replay(draft, turns, aux, convs, K, MAX_NEW, eos)
    live = measure(model, t.tokenizer(), DraftProposer(draft), AUX, convs, K, MAX_NEW, eos)
    for key in ("acceptance_length", "per_position_acceptance", "num_drafts", "num_accepted_tokens",
                "num_accepted_tokens_per_pos", "num_turns", "generated_tokens"):
        assert r[key] == live[key], key
    lo, hi = r["acceptance_length_ci"]
    assert lo <= r["acceptance_length"] <= hi and r["lossless"] is None and r["mode"] == "replay"


def test_walk_follows_the_live_stop_rules():
    # prompt of 2 tokens; answer 5 6 7 <eos=9>; the tail continues 1 2 3
    turn = Turn("x", 0, 2, [0, 1, 5, 6, 7, 9, 1, 2, 3], 4)
    # props[j][t] proposes s[t+2+j]: an always-right draft at t=1 accepts 6 7 9 (k=3), the round emits 4 tokens
    props = torch.zeros(3, 9, dtype=torch.long)
    for j in range(3):
        for t in range(9 - 2 - j):
            props[j, t] = turn.ids[t + 2 + j]
    assert walk(turn, props.numpy(), 3, 40, {9}) == [3]  # the stop token was emitted: done
    assert walk(turn, props.numpy(), 3, 2, {9}) == [3]  # one round, then max_new is reached
    wrong = torch.full((3, 9), 4)
    assert walk(turn, wrong.numpy(), 3, 40, {9}) == [0, 0, 0]  # one token per round until the stop
    with pytest.raises(ValueError, match="tail >= k"):
        walk(Turn("y", 0, 2, [0, 1, 5, 6], 2), props.numpy(), 3, 40, {9})


def test_bootstrap_ci_brackets_tau():
    per = [(10, 10), (0, 10), (5, 10), (20, 10)]
    lo, hi = bootstrap_ci(per)
    assert lo < 1 + 35 / 40 < hi and bootstrap_ci(per) == [lo, hi]  # seeded: reproducible
    assert bootstrap_ci([(3, 3)]) == [2.0, 2.0]


def test_eval_cli_replay_mode(setup, head, tiny_llama_dir, tmp_path):
    from eagle3.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": c}) + "\n" for c in (["Name three colors.", "And three animals?"],
                                                                          ["What is 2+2?"])))
    cache = tmp_path / "cache"
    args = ["eval", "--model", str(tiny_llama_dir), "--draft", str(head), "--prompts", str(prompts), "--k", "3",
            "--max-new-tokens", "24", "--threads", "1", "--replay-cache", str(cache)]
    assert main([*args, "--mode", "replay", "--out", str(tmp_path / "r")]) == 0
    assert main([*args, "--out", str(tmp_path / "l")]) == 0
    r = json.loads((tmp_path / "r" / "report.json").read_text())
    live = json.loads((tmp_path / "l" / "report.json").read_text())
    assert r["mode"] == "replay" and live["mode"] == "live" and live["lossless"] is True
    assert r["acceptance_length"] == live["acceptance_length"] and r["num_drafts"] == live["num_drafts"]
    assert r["lossless"] is None and r["speedup_vs_target"] is None and len(r["acceptance_length_ci"]) == 2
    # replay of every prompt plus a live check of the first: lossless and speed from it, tau from the replay
    assert main([*args, "--mode", "replay", "--live-check", "1", "--out", str(tmp_path / "rl")]) == 0
    rl = json.loads((tmp_path / "rl" / "report.json").read_text())
    assert rl["acceptance_length"] == r["acceptance_length"] and rl["mode"] == "replay"
    assert rl["lossless"] is True and rl["speedup_vs_target"] > 0 and rl["live"]["num_prompts"] == 1
    # abbreviations are refused: `--mod replay` must never be read as `--model replay`
    with pytest.raises(SystemExit) as e:
        main(["eval", "--mod", "replay", "--draft", str(head), "--out", str(tmp_path / "z")])
    assert e.value.code == 2


def test_aux_states_on_packed_linears_equal_stock_to_rounding_and_rebuild_bitwise(setup, tmp_path):
    t, model, draft, convs, cache = setup
    turns, _, _ = continuations(t, model, convs, MAX_NEW, tail=8, cache=cache, batch_size=4)
    base = model.get_decoder()
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    stock, _ = aux_states(base, turns, AUX, tmp_path / "a", packed=False)
    packed, _ = aux_states(base, turns, AUX, tmp_path / "b", packed=True)
    again, _ = aux_states(base, turns, AUX, tmp_path / "c", packed=True)
    # one kernel (timed=False): reruns bitwise equal
    assert all(torch.equal(x, y) for x, y in zip(packed, again, strict=True))
    for x, y in zip(stock, packed, strict=True):  # bf16 states: at most about one rounding step apart
        torch.testing.assert_close(y.float(), x.float(), rtol=2 ** -7, atol=2 ** -7 * x.float().abs().max().item())
    assert type(base.layers[0].mlp.up_proj) is torch.nn.Linear  # the swap is undone


def test_eval_replay_builds_on_build_threads_and_decodes_live_on_threads(setup, head, tiny_llama_dir, tmp_path,
                                                                          monkeypatch):
    import eagle3.eval.run as run
    from eagle3.cli import main

    seen: dict[str, int] = {}
    real_report, real_measure = run.replay_report, run.measure

    def report(*a, **kw):
        seen["build"] = torch.get_num_threads()
        return real_report(*a, **kw)

    def measure(*a, **kw):
        seen["live"] = torch.get_num_threads()
        return real_measure(*a, **kw)

    monkeypatch.setattr(run, "replay_report", report)
    monkeypatch.setattr(run, "measure", measure)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["What is 2+2?"]}) + "\n")
    before = torch.get_num_threads()
    assert main(["eval", "--model", str(tiny_llama_dir), "--draft", str(head), "--prompts", str(prompts),
                 "--max-new-tokens", "8", "--mode", "replay", "--live-check", "1", "--threads", "1",
                 "--build-threads", "2", "--replay-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "r")]) == 0
    assert seen == {"build": 2, "live": 1}
    torch.set_num_threads(before)


def test_load_prompts_mtbench_has_80_two_turn_questions():
    convs, _ = load_prompts("mt-bench")
    assert len(convs) == 80 and all(c.turns == 2 for c in convs)
