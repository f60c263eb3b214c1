"""Replay evaluation on a whole benchmark: cache building time, replay time, and replay == live on real prompts.

Steps, each timed (wall and CPU seconds of this process; on a shared machine wall time also measures
the neighbours):
1. the target's greedy continuations of every turn (batched; cached by content under
   $EAGLE3_CACHE_DIR/replay: 0 s when cached);
2. the aux states of every sequence (one target forward each; cached per aux ids);
3. the replay of the head (one chain pass of the draft at the rounds' positions + the walk), at each
   thread count of `--replay-threads` (the goal: MT-Bench-80, both turns, 256 new tokens, k=3, in at
   most 2 minutes on 2 cores once the caches exist);
4. with `--live N`: live chain speculative decoding (`eagle3.eval.decode.speculative_generate`, batch 1,
   the draft as vLLM's proposer) of the first N conversations, every turn on the cached prompt,
   compared with the replayed rounds round by round: disagreeing rounds, and whether the live output
   equals the cached greedy answer.
Without `--draft` only the caches are built (aux ids: `--aux-layers` or the target's default).

`--compare-build` times building both caches, in fresh temporary dirs, two ways in one process: as
`eagle3 eval` built them before (1 thread, the aux forward on torch's stock linears) and as it builds
them now (`--threads` threads, the aux forward on oneDNN-prepacked linears), and compares the results.

    .venv/bin/python -m benchmarks.speed.replay --draft runs/demo/train/final [--prompts mt-bench] [--k 3]
        [--max-new-tokens 256] [--batch-size 128] [--threads 2] [--replay-threads 1,2] [--live 3]

Last line: one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch

from eagle3.decoding.chains import proposals, walk
from eagle3.eval.decode import DraftProposer, Stats, TargetLM, speculative_generate
from eagle3.eval.prompts import load_prompts
from eagle3.eval.replay import aux_states, continuations, replay
from eagle3.eval.run import cast_draft
from eagle3.model.formats import load_draft
from eagle3.model.target import Target, default_aux_ids

REPO = Path(__file__).resolve().parents[2]


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


class Clock:
    """Wall and CPU seconds of a block."""

    def __enter__(self):
        self.w, self.c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.w, time.process_time() - self.c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default=str(REPO / "assets" / "smollm2"))
    ap.add_argument("--draft", default=None, help="a draft dir (final/); without it only the caches are built")
    ap.add_argument("--prompts", default="mt-bench")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=128, help="rows decoded together while building the cache")
    ap.add_argument("--aux-layers", default=None, help="aux ids for the cache without --draft (default: the target's)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads while building the caches")
    ap.add_argument("--replay-threads", default="2", help="thread counts to time the replay at, e.g. 1,2")
    ap.add_argument("--live", type=int, default=0,
                    help="compare live decoding with replay on the first N conversations")
    ap.add_argument("--cache", default=None, help="cache root (default $EAGLE3_CACHE_DIR/replay)")
    ap.add_argument("--compare-build", action="store_true",
                    help="time the cache build at 1 thread + stock linears against --threads + packed linears")
    a = ap.parse_args()
    if a.compare_build:
        compare_build(a)
        return

    torch.set_num_threads(a.threads)
    target = Target.open(a.model)
    model = target.load_model(head=True, device="cpu")
    eos = target.stop_ids()
    convs, _ = load_prompts(a.prompts, a.limit)
    draft = None
    if a.draft:
        draft, _ = load_draft(a.draft, a.model, model.get_input_embeddings().weight)
        p = next(model.parameters())
        draft = cast_draft(draft, p.device, p.dtype).eval()
        aux_ids = draft.config.aux_layer_ids
    else:
        aux_ids = ([int(x) for x in a.aux_layers.split(",")] if a.aux_layers
                   else default_aux_ids(len(model.get_decoder().layers)))
    res: dict = {"model": a.model, "draft": a.draft, "prompts": a.prompts, "num_prompts": len(convs), "k": a.k,
                 "max_new_tokens": a.max_new_tokens, "batch_size": a.batch_size, "threads": a.threads,
                 "loadavg_start": os.getloadavg()[0]}

    tail = max(a.k, 8)
    with Clock() as c:
        turns, d, gen_s = continuations(target, model, convs, a.max_new_tokens, tail, batch_size=a.batch_size,
                                        cache=Path(a.cache) if a.cache else None, progress=print)
    answer = sum(t.answer_len for t in turns)
    res["continuations"] = {"cached": gen_s == 0.0, "seconds": round(c.wall, 1), "cpu_seconds": round(c.cpu, 1),
                            "turns": len(turns), "answer_tokens": answer,
                            "decoded_tokens": sum(len(t.ids) - t.prompt_len for t in turns),
                            "prompt_tokens": sum(t.prompt_len for t in turns), "cache": str(d),
                            "peak_rss_gib": peak_rss_gib()}
    print(f"continuations: {len(turns)} turns, {answer} answer tokens, "
          f"{'cached' if gen_s == 0.0 else f'built in {c.wall:.1f} s ({c.cpu:.1f} CPU s)'}; peak RSS "
          f"{res['continuations']['peak_rss_gib']} GiB", flush=True)
    with Clock() as c:
        aux, aux_s = aux_states(model.get_decoder(), turns, aux_ids, d)
    res["aux_states"] = {"cached": aux_s == 0.0, "seconds": round(c.wall, 1), "cpu_seconds": round(c.cpu, 1),
                         "tokens": sum(len(t.ids) for t in turns), "bytes": sum(x.numel() * 2 for x in aux),
                         "peak_rss_gib": peak_rss_gib()}
    print(f"aux states {aux_ids}: {res['aux_states']['tokens']} tokens, "
          f"{'cached' if aux_s == 0.0 else f'built in {c.wall:.1f} s ({c.cpu:.1f} CPU s)'}; peak RSS "
          f"{res['aux_states']['peak_rss_gib']} GiB", flush=True)
    if draft is None:
        print(json.dumps(res))
        return

    res["replay"] = []
    report = None
    for n in [int(x) for x in a.replay_threads.split(",")]:
        torch.set_num_threads(n)
        with Clock() as c:
            report = replay(draft, turns, aux, convs, a.k, a.max_new_tokens, eos)
        row = {"threads": n, "seconds": round(c.wall, 1), "cpu_seconds": round(c.cpu, 1),
               "loadavg": os.getloadavg()[0]}
        res["replay"].append(row)
        print(f"replay at {n} thread(s): {c.wall:.1f} s ({c.cpu:.1f} CPU s), load {row['loadavg']:.1f}", flush=True)
    res.update(acceptance_length=report["acceptance_length"], acceptance_length_ci=report["acceptance_length_ci"],
               per_position_acceptance=report["per_position_acceptance"], num_drafts=report["num_drafts"])
    print(f"tau {report['acceptance_length']:.3f} (95% CI {report['acceptance_length_ci'][0]:.3f}-"
          f"{report['acceptance_length_ci'][1]:.3f}), per position "
          f"{[round(x, 3) for x in report['per_position_acceptance']]}", flush=True)

    if a.live:
        torch.set_num_threads(1)  # batch-1 decoding: one thread is fastest on a shared CPU
        ids = {c.id for c in convs[: a.live]}
        sel = [i for i, t in enumerate(turns) if t.conv in ids]
        props = proposals(draft, [turns[i] for i in sel], [aux[i] for i in sel], a.k, a.max_new_tokens)
        live_t, prop = TargetLM(model, aux_ids), DraftProposer(draft)
        rounds = disagree = equal = 0
        for i, p in zip(sel, props, strict=True):
            t = turns[i]
            st = Stats(a.k)
            out = speculative_generate(live_t, prop, t.ids[: t.prompt_len], a.k, a.max_new_tokens, eos, st)
            equal += out == t.ids[t.prompt_len : t.prompt_len + t.answer_len]
            r = walk(t, p, a.k, a.max_new_tokens, eos)
            rounds += len(st.rounds)
            disagree += sum(x != y for x, y in zip(r, st.rounds, strict=False)) + abs(len(r) - len(st.rounds))
        res["live_vs_replay"] = {"conversations": a.live, "turns": len(sel), "live_rounds": rounds,
                                 "disagreeing_rounds": disagree, "live_equals_cached_answer": equal}
        print(f"live vs replay: {len(sel)} turns, {rounds} live rounds, {disagree} disagree; "
              f"live output == cached greedy answer in {equal}/{len(sel)} turns", flush=True)
    res["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(res))


def compare_build(a) -> None:
    """Both caches built twice in fresh dirs: the old way (1 thread, stock aux forward), then the new."""
    import tempfile

    target = Target.open(a.model)
    model = target.load_model(head=True, device="cpu")
    convs, _ = load_prompts(a.prompts, a.limit)
    aux_ids = ([int(x) for x in a.aux_layers.split(",")] if a.aux_layers
               else default_aux_ids(len(model.get_decoder().layers)))
    res: dict = {"prompts": a.prompts, "num_prompts": len(convs), "max_new_tokens": a.max_new_tokens,
                 "batch_size": a.batch_size, "loadavg_start": os.getloadavg()[0], "runs": []}
    built = {}
    for name, threads, packed in (("old", 1, False), ("new", a.threads, True)):
        torch.set_num_threads(threads)
        with tempfile.TemporaryDirectory() as tmp:
            with Clock() as c1:
                turns, d, _ = continuations(target, model, convs, a.max_new_tokens, max(a.k, 8),
                                            batch_size=a.batch_size, cache=Path(tmp), progress=print)
            with Clock() as c2:
                aux, _ = aux_states(model.get_decoder(), turns, aux_ids, d, packed=packed)
        built[name] = (turns, aux)
        row = {"name": name, "threads": threads, "packed_aux": packed,
               "continuations_s": round(c1.wall, 1), "continuations_cpu_s": round(c1.cpu, 1),
               "aux_s": round(c2.wall, 1), "aux_cpu_s": round(c2.cpu, 1), "total_s": round(c1.wall + c2.wall, 1),
               "answer_tokens": sum(t.answer_len for t in turns), "loadavg": os.getloadavg()[0]}
        res["runs"].append(row)
        print(f"{name}: {threads} thread(s), {'packed' if packed else 'stock'} aux forward: continuations "
              f"{c1.wall:.1f} s, aux states {c2.wall:.1f} s, total {c1.wall + c2.wall:.1f} s", flush=True)
    (t0, x0), (t1, x1) = built["old"], built["new"]
    same = [u.ids == v.ids for u, v in zip(t0, t1, strict=True)]
    # relative to the tensor's largest magnitude: SmolLM2's states reach the hundreds, where one bf16 step is 1-2
    diff = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
               for x, y, s in zip(x0, x1, same, strict=True) if s) if any(same) else 0.0
    res.update(speedup=round(res["runs"][0]["total_s"] / res["runs"][1]["total_s"], 2),
               turns_equal=f"{sum(same)}/{len(same)}", aux_max_rel_diff_equal_turns=diff)
    print(f"speedup {res['speedup']}x; answers equal in {res['turns_equal']} turns; aux states differ by at most "
          f"{diff:.3g} of their largest magnitude (bf16) on those", flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
