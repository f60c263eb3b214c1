"""`eagle3 verifier`: tensors equal the model's own, sharded/tied/wrapped layouts, clear errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.cli import main
from eagle3.model.draft import DraftConfig, Eagle3Draft
from eagle3.storage.hashing import sha256_file
from eagle3.storage.manifests import PreparedData, VerifierWeights, VocabMapInfo
from eagle3.train.loss import TargetHead
from eagle3.verifier import extract_verifier


def write_prepared(d: Path, target_ids: list[int], vocab_size: int) -> Path:
    """A minimal prepare output: vocab_map.safetensors + a PreparedData manifest."""
    d.mkdir(parents=True, exist_ok=True)
    ids = torch.tensor(target_ids, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    save_file({"d2t": ids - torch.arange(len(ids)), "t2d": t2d}, str(d / "vocab_map.safetensors"))
    PreparedData(
        vocab_map=VocabMapInfo(sha256=sha256_file(d / "vocab_map.safetensors"), draft_vocab_size=len(ids),
                               target_vocab_size=vocab_size, coverage=1.0),
    ).write(d)
    return d


DRAFT_IDS = [2, 5, 17, 100, 4000, 49151]


def test_smollm2_tied_equals_model(smollm2_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    prepared = write_prepared(tmp_path / "prep", DRAFT_IDS, 49152)
    out = tmp_path / "verifier"
    assert main(["verifier", "--model", str(smollm2_dir), "--prepared", str(prepared), "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["tied_embeddings"] is True
    t = load_file(out / "verifier.safetensors")
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert torch.equal(t["embed_tokens"], model.model.embed_tokens.weight)
    assert torch.equal(t["norm"], model.model.norm.weight)
    assert torch.equal(t["lm_head"], model.lm_head.weight)  # tied: the embedding
    assert torch.equal(t["lm_head_draft"], model.lm_head.weight[DRAFT_IDS])
    assert torch.equal(t["d2t"] + torch.arange(6), torch.tensor(DRAFT_IDS))

    man = VerifierWeights.read(out)
    assert man.tied_embeddings and man.architecture == "LlamaForCausalLM"
    assert (man.vocab_size, man.hidden_size, man.draft_vocab_size) == (49152, 576, 6)
    assert man.tensors["lm_head_draft"].shape == [6, 576] and man.tensors["embed_tokens"].dtype == "float32"
    assert man.tensors["lm_head"].source == "model.embed_tokens.weight (tied)"
    assert man.source_files["model.safetensors"] == sha256_file(smollm2_dir / "model.safetensors")
    assert man.sha256 == sha256_file(out / "verifier.safetensors")
    assert man.inputs["prepared"] == PreparedData.read(prepared).fingerprint

    # the loss targets from these tensors equal the model's own logits restricted to the draft vocab
    x = torch.randn(3, 576)
    logits, top = TargetHead.from_verifier(out)(x)
    with torch.no_grad():
        full = model.lm_head(model.model.norm(x))
    torch.testing.assert_close(logits, full[:, DRAFT_IDS], atol=1e-4, rtol=1e-5)
    ids = torch.tensor(DRAFT_IDS)
    expect = [int((ids == a).nonzero()[0]) if a in DRAFT_IDS else -1 for a in full.argmax(-1).tolist()]
    assert top.tolist() == expect

    # and a fresh draft takes its embedding, lm_head and vocab map from them
    draft = Eagle3Draft.from_verifier(DraftConfig.from_target(smollm2_dir, 6), out)
    assert torch.equal(draft.embed_tokens.weight, t["embed_tokens"])
    assert torch.equal(draft.lm_head.weight, t["lm_head_draft"])
    assert draft.to_target_ids(torch.arange(6)).tolist() == DRAFT_IDS


def test_tiny_llama_sharded_untied(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="2MB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    prepared = write_prepared(tmp_path / "prep", [0, 7, 9], model.config.vocab_size)
    man = extract_verifier(sharded, prepared, tmp_path / "out")
    t = load_file(tmp_path / "out" / "verifier.safetensors")
    assert not man.tied_embeddings
    assert torch.equal(t["embed_tokens"], model.model.embed_tokens.weight)
    assert torch.equal(t["norm"], model.model.norm.weight)
    assert torch.equal(t["lm_head"], model.lm_head.weight)
    assert not torch.equal(t["lm_head"], t["embed_tokens"])
    assert torch.equal(t["lm_head_draft"], model.lm_head.weight[[0, 7, 9]])
    # checksums of exactly the files read: config, index and the shards holding the 3 tensors
    used = {index[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    assert set(man.source_files) == {"config.json", "model.safetensors.index.json"} | used
    assert man.rms_norm_eps == pytest.approx(1e-5)


def _fake_model(d: Path, arch: str, text_prefix: str, head_prefix: str | None, tie: bool | None, wrapped: bool):
    """A safetensors dir with only the tensors that matter, named as a wrapper model names them."""
    V, H = 40, 8
    g = torch.Generator().manual_seed(0)
    t = {f"{text_prefix}embed_tokens.weight": torch.randn(V, H, generator=g),
         f"{text_prefix}norm.weight": torch.rand(H, generator=g),
         f"{text_prefix}layers.0.mlp.up_proj.weight": torch.randn(16, H, generator=g),
         "vision_tower.patch_embed.weight": torch.randn(4, 4, generator=g)}
    if head_prefix is not None:
        t[f"{head_prefix}lm_head.weight"] = torch.randn(V, H, generator=g)
    d.mkdir(parents=True)
    save_file(t, str(d / "model.safetensors"))
    text = {"hidden_size": H, "vocab_size": V, "num_hidden_layers": 1, "rms_norm_eps": 1e-6}
    if tie is not None:
        text["tie_word_embeddings"] = tie
    cfg = {"architectures": [arch], "text_config": text} if wrapped else {"architectures": [arch], **text}
    (d / "config.json").write_text(json.dumps(cfg))
    return t


@pytest.mark.parametrize(
    "arch,text_prefix,head_prefix,wrapped",
    [
        ("LlavaForConditionalGeneration", "language_model.model.", "language_model.", True),
        ("Mistral3ForConditionalGeneration", "model.language_model.", "", True),
        ("KimiVLForConditionalGeneration", "language_model.model.", "language_model.", True),
        ("DeepseekV3ForCausalLM", "model.", "", False),
    ],
)
def test_wrapped_names_resolved_through_architecture(tmp_path, arch, text_prefix, head_prefix, wrapped):
    t = _fake_model(tmp_path / "m", arch, text_prefix, head_prefix, tie=False, wrapped=wrapped)
    prepared = write_prepared(tmp_path / "prep", [1, 3], 40)
    man = extract_verifier(tmp_path / "m", prepared, tmp_path / "out")
    out = load_file(tmp_path / "out" / "verifier.safetensors")
    assert torch.equal(out["embed_tokens"], t[f"{text_prefix}embed_tokens.weight"])
    assert torch.equal(out["norm"], t[f"{text_prefix}norm.weight"])
    assert torch.equal(out["lm_head"], t[f"{head_prefix}lm_head.weight"])
    assert man.tensors["embed_tokens"].source == f"{text_prefix}embed_tokens.weight"
    assert man.rms_norm_eps == pytest.approx(1e-6)


def test_tied_when_config_says_so_or_head_absent(tmp_path):
    t = _fake_model(tmp_path / "a", "LlamaForCausalLM", "model.", None, tie=None, wrapped=False)
    prepared = write_prepared(tmp_path / "prep", [1, 3], 40)
    man = extract_verifier(tmp_path / "a", prepared, tmp_path / "out")
    assert man.tied_embeddings
    assert torch.equal(load_file(tmp_path / "out" / "verifier.safetensors")["lm_head"], t["model.embed_tokens.weight"])


def test_missing_tensors_are_named_with_the_files_searched(tmp_path, capsys):
    _fake_model(tmp_path / "m", "LlamaForCausalLM", "model.", None, tie=False, wrapped=False)
    prepared = write_prepared(tmp_path / "prep", [1, 3], 40)
    rc = main(["verifier", "--model", str(tmp_path / "m"), "--prepared", str(prepared), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "'lm_head.weight' not found in ['model.safetensors']" in err
    _fake_model(tmp_path / "w", "LlavaForConditionalGeneration", "text.", "", tie=False, wrapped=True)
    with pytest.raises(ValueError,
                       match=r"tried \['model.language_model.embed_tokens.weight'.*in \['model.safetensors'\]"):
        extract_verifier(tmp_path / "w", prepared, tmp_path / "o")
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_bad_vocab_map_is_rejected(tmp_path):
    _fake_model(tmp_path / "m", "LlamaForCausalLM", "model.", "", tie=False, wrapped=False)
    with pytest.raises(ValueError, match="t2d has shape"):
        extract_verifier(tmp_path / "m", write_prepared(tmp_path / "p1", [1, 3], 41), tmp_path / "o")
    p2 = write_prepared(tmp_path / "p2", [1, 3], 40)
    save_file({"d2t": torch.tensor([1, 1]), "t2d": torch.zeros(40, dtype=torch.bool)},
              str(p2 / "vocab_map.safetensors"))
    with pytest.raises(ValueError, match="sha256 does not match the prepare manifest"):  # replaced behind its back
        extract_verifier(tmp_path / "m", p2, tmp_path / "o")
    m = PreparedData.read(p2)
    m.vocab_map.sha256 = sha256_file(p2 / "vocab_map.safetensors")  # a map written that way on purpose
    m.write(p2)
    with pytest.raises(ValueError, match="vocab_map.safetensors: t2d does not mark"):
        extract_verifier(tmp_path / "m", p2, tmp_path / "o")
