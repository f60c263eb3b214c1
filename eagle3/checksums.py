"""`eagle3 verify DIR`: check every stage dir under DIR against its manifest's checksums.

Each file a manifest lists is checked against its sha256; a missing, truncated or altered file is
named. The result is one line per stage plus one per bad file; the exit status is 2 if anything is
wrong. A file whose identity (size, mtime, ctime, inode) is unchanged since this host last hashed it
is not read again (`sha256_file_cached`); `--deep` re-reads every byte, which is what catches bit rot
on a disk that changed no metadata, and refreshes this host's stamps.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.flags import UserError
from eagle3.stage import Command
from eagle3.storage.hashing import sha256_file_cached, sha256_json


@dataclass
class Finding:
    stage_dir: Path
    kind: str
    checked: int = 0
    bad: list[str] = field(default_factory=list)


def _files(kind: str, d: Path, m: dict) -> list[tuple[Path, str]]:
    """(path, expected sha256) for every checksummed file of a manifest."""
    out: list[tuple[Path, str]] = []
    if kind == "prepare":
        out += [(d / s["file"], s["sha256"]) for shards in m["splits"].values() for s in shards]
        if m.get("vocab_map"):
            out.append((d / m["vocab_map"]["file"], m["vocab_map"]["sha256"]))
    elif kind == "extract":
        out += [(d / s["file"], s["sha256"]) for s in m["shards"]]
        if m.get("index_sha256"):
            out.append((d / m["index_file"], m["index_sha256"]))
    elif kind in ("verifier", "regenerate"):
        out.append((d / m["file"], m["sha256"]))
    elif kind == "train":
        out.append((d / m["final_dir"] / "model.safetensors", m["weights_sha256"]))
    return out


def read_manifest(d: Path) -> tuple[str, dict | None, str | None]:
    """(kind, the manifest as its typed class validated and dumped, None) or (kind, None, why it is not one)."""
    from eagle3.storage.manifests import StageManifest

    path = d / "manifest.json"
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return "?", None, f"{path}: not valid JSON ({e})"
    if not isinstance(data, dict):
        return "?", None, f"{path}: a JSON {type(data).__name__}, not a manifest (a JSON object)"
    kinds = StageManifest.kinds()
    kind = data.get("kind")
    if kind not in kinds:
        return str(kind), None, f"{path}: kind {kind!r} is no stage's (one of {', '.join(sorted(kinds))})"
    try:
        man = kinds[kind].read(d)
    except ValueError as e:  # a wrong version, a wrong type
        return kind, None, " ".join(str(e).split())[:400]
    # Every field has a default, so a manifest missing keys still parses: its sealed fingerprint, over its whole
    # content, is what tells a manifest eagle3 wrote from one edited or written by hand.
    if man.fingerprint != sha256_json(man._content()):
        return kind, None, (f"{path}: its fingerprint does not match its content (keys missing or edited; "
                            "not as eagle3 wrote it): rerun the stage")
    return kind, man.model_dump(mode="json"), None


def verify_dir(d: Path, deep: bool = False) -> Finding:
    kind, m, why = read_manifest(d)
    f = Finding(d, kind)
    if m is None:
        f.bad.append(why)
        return f
    for path, digest in _files(f.kind, d, m):
        f.checked += 1
        if not path.is_file():
            f.bad.append(f"{path}: missing")
        elif sha256_file_cached(path, rehash=deep) != digest:
            f.bad.append(f"{path}: sha256 differs from the manifest (corrupt or truncated)")
    if f.kind == "train":
        from eagle3.train import checkpoint as ckpt

        for c in ckpt.step_dirs(d) + ([d / ckpt.CKPT_DIR / ckpt.BEST]
                                      if (d / ckpt.CKPT_DIR / ckpt.BEST).is_dir() else []):
            f.checked += 1
            if why := ckpt.problem(c, rehash=deep):
                f.bad.append(f"{why} (a resume skips this checkpoint)")
    if f.kind == "eval" and not (d / "report.json").is_file():
        f.bad.append(f"{d / 'report.json'}: missing")
    return f


def verify_tree(root: str | Path, deep: bool = False) -> list[Finding]:
    root = Path(root)
    if not root.exists():
        raise ValueError(f"{root} does not exist")
    dirs = sorted({p.parent for p in root.rglob("manifest.json")
                   if ".tmp" not in str(p) and "checkpoints" not in p.parts})
    if not dirs:
        raise ValueError(f"{root}: no stage manifest (manifest.json) found")
    return [verify_dir(d, deep) for d in dirs]


def report(root: str | Path, deep: bool, emit) -> list[str]:
    """`eagle3 verify`'s output, a line per stage dir and one per bad file, through `emit`; returns the
    problems found (bad files, manifests that are not eagle3's)."""
    bad: list[str] = []
    for f in verify_tree(root, deep=deep):
        emit(f"{'OK ' if not f.bad else 'BAD'} {f.kind:<9} {f.stage_dir} ({f.checked} files checked)")
        for b in f.bad:
            emit(f"    {b}")
        bad += f.bad
    return bad


def _main(a) -> None:
    if bad := report(a.dir, a.deep, print):
        raise UserError(f"{len(bad)} problem(s) found under {a.dir}; the first: {bad[0]}")


COMMAND = Command(
    name="verify", help="check every stage dir under DIR against its manifest checksums", main=_main,
    flags=(("dir", dict(help="a run dir (or one stage dir)")),
           ("--deep", dict(action="store_true", help="re-read every byte, even of files this host already hashed at "
                           "their current identity (size, mtime, ctime, inode)"))),
)
