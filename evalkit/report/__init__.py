"""The deployment report (`make report`): is a compressed KV cache as good as the full one, and what does its
budget buy? Reads the runs' `metrics.json` and `samples.jsonl`, pairs every compressed run with the `full`
run that generated from the same prompts, and writes `<results_dir>/report/{report.md,report.csv,*.png}`:

    runs.py     reading run folders (bad files named and skipped), identities, samples
    pairing.py  which full run a compressed run is compared with, and the sample-by-sample pairing
    stats.py    paired bootstrap CI, McNemar / sign-flip p-values, verdicts, sample sizes
    lengths.py  output length and failure per paired problem: token ratio and its CI, hit limit, no answer,
                repeating tail
    budget.py   the memory model joined at the task's context length (KV bytes, max batch, tok/s)
    build.py    the cells, recommendations and missing cells
    columns.py  every column of the report and the leaderboard, declared once (docs/report.md's glossary)
    tables.py   report.md; plots.py: forest, Pareto and length plots; render.py writes them and report.csv
No model is loaded: hundreds of runs take seconds.
"""

from evalkit.report.config import ReportConfigError, ReportSettings, settings

__all__ = ["ReportConfigError", "ReportSettings", "settings", "write_report"]


def write_report(s: ReportSettings) -> dict:
    """Build and write the report; the paths written."""
    from evalkit.report.build import build
    from evalkit.report.render import write

    return write(build(s))
