"""vLLM-Omni's real worker installing pagedkv's metadata (issue 49): vLLM-Omni 0.30's
``DiffusionKVModelRunnerBackend`` (the model runner's paged-KV half: its validator, its generation and conflict
rules, its row registry) writing vLLM 0.30's native ``BlockTables``, as a DiT stage's worker does for each scheduled
request. Both managers run in lockstep over fuzzed request streams, each feeding a worker of its own: every snapshot
pagedkv sends is accepted and lands in the worker's block table as sent (the same rows, block for block, as
vLLM-Omni's manager's), a snapshot sent again is a no-op, a stale or conflicting one is refused with the worker's
state unchanged, and a request whose rows the worker cannot hold is refused by pagedkv at admission where vLLM-Omni's
own manager reserves it and its install fails.

Where CUDA is, on the GPU. Where it is not (CI), on the CPU: the block tables take vLLM's explicit-copy buffers (its
own fallback where pinned memory is not available, as in a CPU-only torch) and their writes run vLLM's Triton kernel
in Triton's interpreter (the conftest sets ``TRITON_INTERPRET=1`` before vLLM is imported).

What is not the worker's real path: the KV tensors and attention backends that ``initialize_kv_cache`` binds beside
its block tables (they need vLLM's compiled kernels); ``bind_block_tables`` gives the backend the block tables
``initialize_kv_cache`` makes, through the platform's class and with its arithmetic."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "vllm_omni.diffusion.diffusion_kv.model_runner_backend", reason="vLLM-Omni 0.30 is not installed here"
)

from vllm.config import DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.worker import block_table as native_block_table
from vllm.v1.worker.gpu import buffer_utils
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_kv.config import DiffusionKVCacheMode
from vllm_omni.diffusion.diffusion_kv.manager import DiffusionKVAdmissionError, DiffusionKVCacheManager
from vllm_omni.diffusion.diffusion_kv.model_runner_backend import DiffusionKVModelRunnerBackend
from vllm_omni.platforms import current_omni_platform

from pagedkv.integrations.vllm_omni.manager import PagedKVDiffusionManager
from tests.integrations_omni.test_vllm_omni_manager import Hooks, Lockstep, fuzz, kv_config, kv_requests

MAX_ROWS = 4  # the adapter's diffusion_kv_max_rows_per_request
MAX_NUM_SEQS = 64  # worker rows: a multiple of MAX_ROWS
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def explicit_copies_without_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """On the CPU: vLLM's buffers without pinned memory (its ``NonUvaBuffer``; its CPU platform claims UVA, which a
    CPU-only torch cannot pin)."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    yield


def worker(model_dir: Path, kv_cache_config: Any, max_model_len: int) -> DiffusionKVModelRunnerBackend:
    """A DiT stage's paged-KV worker backend over ``kv_cache_config`` on the GPU, its block tables bound."""
    config = model_dir / "config.json"
    if not config.exists():  # (a small Llama's config: ModelConfig reads one; no weights are loaded)
        config.write_text(
            json.dumps(
                {
                    "architectures": ["LlamaForCausalLM"],
                    "model_type": "llama",
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 1,
                    "num_hidden_layers": 1,
                    "vocab_size": 1024,
                    "max_position_embeddings": 1024,
                }
            )
        )
    vllm_config = VllmConfig(
        device_config=DeviceConfig(device=DEVICE.type),
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=max_model_len),
        scheduler_config=SchedulerConfig(
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=4096,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
    )
    od_config = OmniDiffusionConfig(
        diffusion_kv_mode=DiffusionKVCacheMode.PAGED_SCHEDULER, diffusion_kv_max_rows_per_request=MAX_ROWS
    )
    backend = DiffusionKVModelRunnerBackend(vllm_config=vllm_config, od_config=od_config, device=DEVICE)
    bind_block_tables(backend, kv_cache_config)
    return backend


def bind_block_tables(backend: DiffusionKVModelRunnerBackend, kv_cache_config: Any) -> None:
    """``initialize_kv_cache``'s block-table half: the platform's BlockTables, as wide as a row of
    ``max_model_len`` needs, a row for each of ``max_num_seqs``; every worker row free."""
    vc = backend.vllm_config
    groups = kv_cache_config.kv_cache_groups
    sizes = [g.kv_cache_spec.block_size for g in groups]
    widths = [
        native_block_table.get_block_table_width(
            g.kv_cache_spec.max_num_blocks_per_req(vc, vc.model_config.max_model_len), bs
        )
        for g, bs in zip(groups, sizes, strict=True)
    ]
    backend.block_tables = current_omni_platform.get_diffusion_kv_block_tables_cls()(
        block_sizes=sizes,
        max_num_reqs=MAX_NUM_SEQS,
        max_num_batched_tokens=vc.scheduler_config.max_num_batched_tokens,
        max_num_blocks_per_group=widths,
        device=backend.device,
        kernel_block_sizes=sizes,
    )
    backend.kv_cache_config = copy.deepcopy(kv_cache_config)
    backend._diffusion_kv_free_rows = list(range(MAX_NUM_SEQS - 1, -1, -1))


def table(backend: DiffusionKVModelRunnerBackend, pid: str, sequence_id: int) -> list[list[int]]:
    """What the worker's block table holds for a row, group by group (read back from the GPU)."""
    tables = backend.block_tables
    row = backend.get_diffusion_kv_row(pid, sequence_id)
    return [t.gpu[row, : int(tables.num_blocks.np[g, row])].tolist() for g, t in enumerate(tables.block_tables)]


def registry(backend: DiffusionKVModelRunnerBackend) -> tuple[Any, ...]:
    return (
        dict(backend._diffusion_kv_identity_to_row),
        list(backend._diffusion_kv_free_rows),
        {k: (s.generation, s.snapshot) for k, s in backend._diffusion_kv_request_states.items()},
    )


def install(backend: DiffusionKVModelRunnerBackend, md: Any) -> None:
    """The worker's install of a new snapshot: accepted; its rows in the block table as sent; sent again, a no-op;
    a conflicting one (a block moved) refused with the worker unchanged."""
    assert backend.install_diffusion_kv_metadata(md) is True
    for s in md.sequences:
        assert table(backend, md.request_id, s.sequence_id) == [list(ids) for ids in s.block_ids]
    before = registry(backend)
    assert backend.install_diffusion_kv_metadata(copy.deepcopy(md)) is False
    moved = copy.deepcopy(md)
    moved.sequences[0].block_ids[0].reverse()
    if moved.sequences[0].block_ids != md.sequences[0].block_ids:
        with pytest.raises(ValueError, match="Conflicting"):
            backend.install_diffusion_kv_metadata(moved)
    assert registry(backend) == before


class Workers(Hooks):
    """``fuzz`` with each manager's snapshots installed on a worker of its own; a freed request's rows retired by its
    generation; a request admitted again under the id of one freed before: its old snapshot is stale."""

    again = 0.2

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.workers: dict[str, DiffusionKVModelRunnerBackend] = {}
        self.retired: dict[str, dict[str, Any]] = {}  # a freed request's last snapshots
        self.installed = 0

    def start(self, lk: Lockstep) -> None:
        for name in ("theirs", "ours"):
            self.workers[name] = worker(
                self.model_dir, kv_config(lk.num_blocks, lk.block_size, lk.groups), lk.max_model_len
            )

    def reserved(self, lk: Lockstep, pid: str) -> None:
        for name, w in self.workers.items():
            install(w, getattr(lk, name).get_metadata(pid))
            if pid in self.retired:
                before = registry(w)
                with pytest.raises(ValueError, match="Stale"):
                    w.install_diffusion_kv_metadata(self.retired[pid][name])
                assert registry(w) == before
        self.installed += 1
        assert table(self.workers["theirs"], pid, 0) == table(self.workers["ours"], pid, 0)

    def freeing(self, lk: Lockstep, pid: str) -> None:
        snapshots = {name: getattr(lk, name).get_metadata(pid) for name in self.workers}
        for name, md in snapshots.items():
            assert self.workers[name].remove_diffusion_kv_requests([(pid, md.allocation_generation)]) == len(
                md.sequences
            )
        self.retired[pid] = snapshots


@pytest.mark.parametrize("seed", range(24))
def test_the_worker_installs_every_snapshot_pagedkv_sends_and_refuses_stale_ones(
    seed: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    hooks = Workers(tmp_path_factory.getbasetemp())
    lk = fuzz(seed, ticks=120, hooks=hooks)
    assert hooks.installed == len(lk.generations["ours"])  # (every admission went to the workers)
    assert registry(hooks.workers["theirs"])[1] == registry(hooks.workers["ours"])[1]  # the same worker rows free


def test_rows_the_worker_cannot_hold_are_refused_at_admission_not_at_install(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``max_rows_per_request`` set to the adapter's limit: a request of more CFG rows is refused by pagedkv's manager
    ("never", nothing held); vLLM-Omni's own manager reserves its blocks and the worker's install refuses it."""
    kw = {"max_model_len": 256, "scheduler_block_size": 8, "hash_block_size": 8, "enable_prefix_caching": True}
    rows = [(8, 8, tuple(range(8)))] * (MAX_ROWS + 1)
    theirs = DiffusionKVCacheManager(kv_config(64, 8), **kw)
    md = theirs.reserve_request("a", kv_requests("a", rows))
    assert md is not None
    w = worker(tmp_path_factory.getbasetemp(), kv_config(64, 8), 256)
    with pytest.raises(ValueError, match="adapter limit"):
        w.install_diffusion_kv_metadata(md)
    ours = PagedKVDiffusionManager(kv_config(64, 8), max_rows_per_request=MAX_ROWS, **kw)
    with pytest.raises(DiffusionKVAdmissionError, match="rows"):
        ours.reserve_request("a", kv_requests("a", rows))
    assert not ours.has_request("a")
    install(w, ours.reserve_request("a", kv_requests("a", rows[:MAX_ROWS])))


def test_a_callers_hashes_past_the_stable_prefix_key_nothing_there(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Where a caller's hashes reach past a row's stable prefix, vLLM-Omni 0.30's manager looks them up too and can
    hand out a cached prefix longer than the prefix, which its own worker refuses; pagedkv's keys the prefix's
    blocks alone (the only ones either manager publishes) and its snapshot installs."""
    kw = {"max_model_len": 256, "scheduler_block_size": 8, "hash_block_size": 8, "enable_prefix_caching": True}
    given = (bytes([1]) * 32, bytes([2]) * 32)
    snapshots = []
    for m in (DiffusionKVCacheManager(kv_config(40, 8), **kw), PagedKVDiffusionManager(kv_config(40, 8), **kw)):
        m.reserve_request("a", kv_requests("a", [(16, 8, given)]))
        m.publish_request("a")  # (both blocks of a's prefix cached under the caller's hashes)
        m.free_request("a")
        snapshots.append(m.reserve_request("b", kv_requests("b", [(12, 8, given)])))  # a prefix of 1.5 blocks
    theirs, ours = snapshots
    assert [s.cached_prefix_len for s in theirs.sequences] == [16]  # past b's prefix of 12
    assert [s.cached_prefix_len for s in ours.sequences] == [8]
    w = worker(tmp_path_factory.getbasetemp(), kv_config(40, 8), 256)
    with pytest.raises(ValueError, match="within the stable prefix"):
        w.install_diffusion_kv_metadata(theirs)
    install(w, ours)
