"""Simulated accelerator memory report: what a KV budget saves in memory and gains in decode throughput.

The paper's case (SnapStream, arXiv 2511.03092, Table 5) is DeepSeek-R1 on 16 SambaNova SN40L sockets;
any Hugging Face config, hardware (`conf/hardware/*.yaml`), context length and budget work. Modules:
`model` (KV geometry and weights from a config), `sharding` (per-GPU bytes of a torchrun layout, as
transformers' tensor-parallel plan shards the model), `sim` (placement, max batch, step time), `report`
(sweep, Table 5 check, measured runs), `render` (Markdown and plots); `python -m evalkit.memory` runs it.
"""

from evalkit.memory.model import (
    KVGeometry,
    MemoryReportError,
    ModelSpec,
    count_parameters,
    kv_geometry,
    model_spec,
)
from evalkit.memory.report import measured_rows, paper_check, sweep_rows, write_report
from evalkit.memory.sharding import Sharding, shard_model
from evalkit.memory.sim import Deployment, Hardware, kv_entries

__all__ = [
    "Deployment",
    "Hardware",
    "KVGeometry",
    "MemoryReportError",
    "ModelSpec",
    "Sharding",
    "count_parameters",
    "kv_entries",
    "kv_geometry",
    "measured_rows",
    "model_spec",
    "paper_check",
    "shard_model",
    "sweep_rows",
    "write_report",
]
