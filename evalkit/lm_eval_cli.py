"""`lm_eval --model evalkit`: evalkit's LM as lm-eval's CLI loads it (registered by
evalkit/lm_eval_plugin.py).

The same generations as `evalkit.lm.EvalkitLM`; in addition it keeps each generation's statistics and hands
lm-eval the run's KV and generation figures (as in metrics.json: `kv`, `generation`) through
`get_model_info`, which lm-eval stores under `config.evalkit` in its results JSON (`--output_path`). It also
keeps HFLM's two warnings about an already-loaded model quiet: evalkit loads the model itself, on purpose.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

from evalkit.lm import EvalkitLM
from evalkit.lm_eval_plugin import QuietFilter
from evalkit.summary import generation_summary, kv_summary

PRELOADED = [  # HFLM's words when `pretrained` is a model object, which is how evalkit hands it over
    ("", "`pretrained` model kwarg is not of type `str`"),
    ("", "Passed an already-initialized model through `pretrained`"),
]


@contextmanager
def _quiet(logger_name: str, rules: list[tuple[str, str]]):
    logger, f = logging.getLogger(logger_name), QuietFilter(rules)
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


class CliLM(EvalkitLM):
    def __init__(self, *args, **kwargs):
        self.generations: list[dict] = []  # each finished generation's stats, as the journal records them
        with _quiet("lm_eval.models.huggingface", PRELOADED):
            super().__init__(*args, **kwargs)

    def _result(self, done) -> tuple[str, dict]:
        text, stats = super()._result(done)
        self.generations.append(stats)
        return text, stats

    def get_model_info(self) -> dict:
        """HFLM's model info plus `evalkit`: the method, the KV storage and the KV and generation figures of
        this run."""
        return super().get_model_info() | {
            "evalkit": {
                "method": self.kv_method.describe(),
                "storage": self.storage.describe(),  # --model_args kv=fp8_e4m3
                "kv": kv_summary(self.generations, self.model.config.get_text_config()),
                "generation": generation_summary(self.generations),
            }
        }
