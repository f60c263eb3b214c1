"""The installed `eagle3` command: the library's subcommands (eagle3/cli.py) plus `eagle3 run`, the whole
pipeline as a Prefect flow. It lives here, above the flows it starts, so the library never imports them."""
from __future__ import annotations

import json
import os
import sys

from eagle3 import cli
from eagle3.model.target import Target
from eagle3.runtime.vllm_engine import on_cpu, resolve_dtype, serve_command


def _run(a) -> None:
    from eagle3.config import PipelineConfig

    cfg = PipelineConfig.from_file(a.config)
    if a.run_dir:
        cfg = cfg.model_copy(update={"run_dir": a.run_dir})
    if a.dry_run:
        from eagle3.planning import measure_host, plan
        from eagle3.planning.fit import fit

        host = measure_host(cfg)
        cfg, fitted = fit(cfg, host, keep=False)
        p = plan(cfg, host=host)
        print(f"preflight for {a.config}: {p.time_line()}\n{p.host.line()}\n~{p.tokens:,} tokens\n{p.table()}")
        if fitted:
            print(fitted.line())
        print("\n".join(f"PROBLEM: {x}" for x in p.problems) or "OK: every remaining stage fits")
        return
    # With no PREFECT_API_URL every run starts a temporary local Prefect server: ~18 s cold on a 2-core
    # machine, against Prefect's 20 s default startup timeout. Analytics off: SQLite logs "database is locked".
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if os.environ.get("PREFECT_HOME"):  # the embedded server's SQLite file goes there; a missing dir times it out
        os.makedirs(os.path.expanduser(os.environ["PREFECT_HOME"]), exist_ok=True)
    from eagle3.planning import measure_host
    from flows.pipeline import pipeline

    # The host probe (cached per process, so the flow's preflight reuses it) runs before the embedded Prefect
    # server starts, so the server's start-up does not share the cores with the kernels it times.
    measure_host(cfg)
    result = pipeline(cfg)
    r = result.pop("report")
    print(json.dumps(result, indent=1))
    final = os.path.abspath(result["final"])
    ci = f" (95% CI {r.acceptance_length_ci[0]:.3f}-{r.acceptance_length_ci[1]:.3f})" if r.acceptance_length_ci else ""
    print(f"\ntau (acceptance length) = {r.acceptance_length:.3f}{ci} at k={r.k} on {r.num_prompts} prompts "
          f"({cfg.eval.prompts}, {r.mode}); speedup {r.speedup_vs_target or 0:.2f}x over greedy; "
          f"lossless: {r.lossless}")
    print(f"draft: {final}")
    # the target's own engine arguments (text-only for a VLM, the CPU MLA backend), as the eval's engines had them
    own = Target.open(cfg.model).vllm_args(resolve_dtype("auto"), on_cpu())
    if cfg.trust_remote_code:
        own["trust_remote_code"] = True
    print(f"serve it: {serve_command(os.path.abspath(cfg.model), final, r.k, own)}")


def build_parser():
    ap = cli.build_parser()
    sub = next(x for x in ap._actions if x.dest == "cmd")
    p = sub.add_parser("run", help="run the whole pipeline as a Prefect flow (embedded Prefect, no server needed)",
                       allow_abbrev=False)
    p.add_argument("--config", required=True, help="PipelineConfig as YAML or JSON")
    p.add_argument("--run-dir", default=None, help="override the config's run_dir")
    p.add_argument("--dry-run", action="store_true", help="print the preflight estimate (disk, memory) and exit")
    p.add_argument(cli.DEBUG[0], **cli.DEBUG[1])
    p.set_defaults(func=_run)
    return ap


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, parser=build_parser())


if __name__ == "__main__":
    sys.exit(main())
