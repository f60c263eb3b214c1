"""Every `eagle3` command, and the stages among them in pipeline order: the one list the CLI, the Prefect
tasks (their cache keys) and the flow's stage table iterate over. A new stage is a package with a `STAGE`
(eagle3/stage.py says what it holds), listed here."""
from __future__ import annotations

from eagle3 import assets, checksums, eval, extract, prepare, regenerate, train, verifier
from eagle3.stage import Command, Stage

STAGES: dict[str, Stage] = {s.name: s for s in (regenerate.STAGE, prepare.STAGE, extract.STAGE, verifier.STAGE,
                                                train.STAGE, eval.STAGE)}
COMMANDS: dict[str, Command] = {c.name: c for c in (assets.COMMAND, *STAGES.values(), extract.PRODUCE, eval.REPLAY_SET,
                                                    checksums.COMMAND)}
