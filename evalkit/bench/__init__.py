"""`make bench`: speed and memory of the KV methods on the embedded model, measured side by side in one run.

One module per measurement, each a function returning rows and a `MEASUREMENT` record; `__main__.py` lists
them and writes `results/bench/*.csv`, then `summary.md` assembled from those CSVs (ratios, not absolute
times, are the point):
  prefill_overhead.csv  SnapStream (and evalkit's full cache) prefill time / transformers' DynamicCache
                        prefill
  decode_speed.csv      decode tokens/s, full vs SnapStream budgets, after 2k-16k-token prompts, with roofline
  fixed_kv.csv          tokens/s at a fixed KV memory budget: the largest batch each method fits, measured
                        beside evalkit.memory's prediction
  memory.csv            peak RSS (prefill and decode) and cache bytes per configuration, each in a fresh
                        process
  decode_steps.csv      per-step decode time over 512 steps (flat for the ring, growing for full), plus a plot
  profile.csv           top operators of one decode step (torch.profiler; full tables in profile.txt)
  batch_throughput.csv  long decodes (AIME-style) at batch 1, 4, 8
  sweep_prefill.csv     a 4-budget RULER sweep: one shared prefill per prompt vs 4 separate runs
  compiled_decode.csv   decode tokens/s eager vs compiled (static cache, torch.compile), full and SnapStream
                        512 after 2k-16k-token prompts, with compile time, token agreement, roofline and
                        flatness
  grading.csv           LiveCodeBench grading of the bundled sample, one problem at a time vs pooled
`provenance.json` says which command, preset and commit wrote each CSV.
"""

__all__ = ["decode_speed", "prefill_overhead"]


def __getattr__(name: str):
    # scripts/gpu_bench.py imports these from the package; importing them lazily keeps `python -m
    # evalkit.bench --help` (which imports this package first) free of torch
    if name == "decode_speed":
        from evalkit.bench.decode import decode_speed

        return decode_speed
    if name == "prefill_overhead":
        from evalkit.bench.prefill import prefill_overhead

        return prefill_overhead
    raise AttributeError(f"module 'evalkit.bench' has no attribute {name!r}")
