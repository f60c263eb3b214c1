"""The outputs of `eagle3 eval`: report.json, samples.jsonl, acceptance.png, then manifest.json last."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from eagle3.storage.manifests import EvalReport

log = logging.getLogger("eagle3.eval")

REPORT = "report.json"
PLOT = "acceptance.png"
SAMPLES = "samples.jsonl"


def plot_acceptance(report: dict[str, Any], path: Path, title: str = "") -> bool:
    """Bar chart of per-position acceptance (share of verify passes accepting position i). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no %s (pip install 'eagle3[plots]')", path.name)
        return False
    acc = report["per_position_acceptance"]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    ax.bar(range(1, len(acc) + 1), acc, color="#3b7dd8")
    for i, a in enumerate(acc, 1):
        ax.text(i, a + 0.01, f"{a:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.1)
    ax.set_xticks(range(1, len(acc) + 1))
    ax.set_title(title or f"k={report['k']}  tau={report['acceptance_length']:.3f}", fontsize=9)
    fig.tight_layout()
    from eagle3.storage.atomic import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return True


def write_outputs(out: Path, report: dict[str, Any], manifest) -> Any:
    """report.json, samples.jsonl, acceptance.png, then manifest.json last (its presence = done)."""
    from eagle3.storage.atomic import atomic_write_json, atomic_write_text, clean_temp_files

    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    clean_temp_files(out)
    items = report.pop("items", [])
    atomic_write_text(out / SAMPLES, "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items))
    report["lossless_failures"] = [
        {"id": it["id"], "turn": i, "first_mismatch": t["first_mismatch"]}
        for it in items for i, t in enumerate(it["turns"]) if not t.get("lossless", True)  # replay checks none
    ]
    has_plot = plot_acceptance(report, out / PLOT, f"{manifest.draft_dir}  k={report['k']}  "
                               f"tau={report['acceptance_length']:.3f}")
    atomic_write_json(out / REPORT, report)
    manifest.plot_file = PLOT if has_plot else ""
    manifest.write(out)
    return manifest


def finish_report(out, report: dict[str, Any], cfg, model_dir, draft_dir, inputs: dict[str, str]) -> EvalReport:
    """The EvalReport manifest of a measured report dict, written with report.json and the plot."""
    m = EvalReport(
        config=cfg.model_dump(mode="json"),
        inputs=inputs,
        model_dir=str(model_dir),
        draft_dir=str(draft_dir),
        **{f: report[f] for f in EvalReport.RESULTS},
        mode=report.get("mode", "live"), acceptance_length_ci=report.get("acceptance_length_ci"),
    )
    return write_outputs(Path(out), report, m)
