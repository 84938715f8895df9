"""The engine through the faults and misuse of issue 17: each case failed before its fix."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama
from pagedkv.shell.engine import Engine, SamplingParams

CFG = replace(SMOLLM2_SHAPES, vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
              num_kv_heads=2, max_position=32)  # fmt: skip


def test_requests_that_reach_max_model_len_end_as_length_and_give_their_rows_back() -> None:
    """Issue 17, defect 1: the scheduler ends such a request in plan.finished; the engine kept its worker
    row, so after max_num_seqs of them every install failed ("0 buffer rows free")."""
    eng = Engine(random_llama(CFG), IdTokenizer(), kv_cache_memory_bytes=1 << 20, max_num_seqs=2, block_size=4)
    prompts = [(f"p{i}", [(5 * i + j) % 300 for j in range(20)], SamplingParams(max_tokens=50)) for i in range(5)]
    done = eng.generate(prompts)
    for c in done:
        # 12 positions fit after the prompt; the last one's logits still give a 13th token (kept, never cached)
        assert c.finish_reason == "length" and len(c.token_ids) == 32 - 20 + 1 and c.text, c
    assert not eng.worker.rows and len(eng.worker.free_rows) == eng.worker.max_rows
    assert eng.state.kv.free_blocks == eng.cache.usable_blocks
    (again,) = eng.generate([("q", [1, 2, 3], SamplingParams(max_tokens=4))])  # and it still serves
    assert len(again.token_ids) == 4


def test_the_default_seed_is_the_same_in_every_process() -> None:
    """Issue 17, defect 9: an unseeded request's seed came from ``hash(str(id))``, which PYTHONHASHSEED
    changes; now it is the id's CRC-32."""
    code = "from pagedkv.shell.sampling import SamplingParams, request_seed; print(request_seed('req-7', SamplingParams()))"
    seeds = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={"PYTHONHASHSEED": str(h), "PATH": ""}).stdout for h in (1, 2, 3)}  # fmt: skip
    assert len(seeds) == 1


def test_generated_ids_never_collide_with_given_ones() -> None:
    """Issue 17, defect 8 (ids): ``generate`` named its requests ``req-{len(requests)}``, so a waiting
    ``req-1`` given to ``add_request`` made it raise DUPLICATE_REQUEST, and a finished one had its
    completion replaced."""
    eng = Engine(random_llama(CFG), IdTokenizer(), kv_cache_memory_bytes=1 << 20, block_size=4)
    eng.add_request("req-1", "", [1, 2, 3], SamplingParams(max_tokens=3))
    first = eng.generate([("a", [4, 5], SamplingParams(max_tokens=2)), ("b", [6], SamplingParams(max_tokens=2))])
    assert [c.request_id for c in first] == ["req-0", "req-2"] and len(eng.requests["req-1"].completion.token_ids) == 3
    (more,) = eng.generate([("c", [7], SamplingParams(max_tokens=2))])
    assert more.request_id == "req-3" and eng.requests["req-0"].completion is first[0]
