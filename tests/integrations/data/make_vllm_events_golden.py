"""Writes tests/integrations/data/vllm_events.msgpack: the scenario's events as vLLM 0.33's own msgspec types encode
them. Run where vLLM is installed (../shared/peers' venv): python tests/integrations/data/make_vllm_events_golden.py"""

from __future__ import annotations

import pathlib
import sys

import msgspec
from vllm.distributed import kv_events as v

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from pagedkv.integrations.vllm.events import to_vllm_batch  # noqa: E402
from tests.integrations.vllm_events_scenario import CONFIG, events  # noqa: E402

ours = to_vllm_batch(events(), CONFIG, ts=1700000000.25, data_parallel_rank=0)
kinds = {"BlockStored": v.BlockStored, "BlockRemoved": v.BlockRemoved, "AllBlocksCleared": v.AllBlocksCleared}
theirs = v.KVEventBatch(
    ts=ours.ts,
    data_parallel_rank=ours.data_parallel_rank,
    events=[kinds[type(e).__name__](**msgspec.structs.asdict(e)) for e in ours.events],
)
out = pathlib.Path(__file__).with_name("vllm_events.msgpack")
out.write_bytes(msgspec.msgpack.Encoder().encode(theirs))
print(f"{out}: {len(ours.events)} events, {out.stat().st_size} bytes")
