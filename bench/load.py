"""Loading a Hugging Face checkpoint directory: pagedkv's ``load_model`` beside transformers' ``from_pretrained``
of the same directory, each in a fresh process: seconds to a model ready to serve, and the process's peak RSS.

The directory is SmolLM2-135M-Instruct's GGUF read by transformers and saved with ``save_pretrained`` (made once
under --dir, in the --save-dtype), loaded to fp32 on the CPU. Medians of --repeats alternating runs.

    python bench/load.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
kind, path = sys.argv[1], sys.argv[2]
if kind == "pagedkv":
    from pagedkv.models.hf import load_model
    model, tok, _ = load_model(path, dtype=torch.float32)
else:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path)
dt = time.perf_counter() - t0
hwm = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])  # (ru_maxrss survives exec: not it)
print(json.dumps({"seconds": dt, "peak_rss_mib": hwm / 1024}))
"""


def make(path: str, dtype: str) -> None:
    import torch
    import transformers

    from pagedkv.models.gguf import SMOLLM2_FILE, load_tokenizer_meta, smollm2_path
    from pagedkv.models.tokenizer import Tokenizer

    read = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path()), gguf_file=SMOLLM2_FILE, dtype=torch.float32
    )
    cfg = {k: v for k, v in read.config.to_dict().items() if k != "quantization_config"}
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    hf.load_state_dict(read.state_dict())
    hf.to(getattr(torch, dtype)).save_pretrained(path)
    meta = load_tokenizer_meta()
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(Tokenizer(meta).to_json())
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "eos_token": "<|im_end|>",
                "chat_template": meta["tokenizer.chat_template"],
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            f,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/smollm2-hf")
    ap.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = f"{args.dir}-{args.save_dtype}"
    if not os.path.exists(os.path.join(path, "config.json")):
        make(path, args.save_dtype)
    runs: dict[str, list[dict[str, float]]] = {"pagedkv": [], "transformers": []}
    for _ in range(args.repeats):
        for kind in runs:
            out = subprocess.run([sys.executable, "-c", CHILD, kind, path], capture_output=True, text=True, check=True)
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    print(
        f"SmolLM2-135M-Instruct saved in {args.save_dtype} ({size / 2**20:.0f} MiB of safetensors), loaded to fp32 "
        f"on the CPU; medians of {args.repeats} fresh processes (imports included)\n"
    )
    print("| loader | seconds | peak RSS MiB |\n|---|---:|---:|")
    med = {
        k: (statistics.median(r["seconds"] for r in v), statistics.median(r["peak_rss_mib"] for r in v))
        for k, v in runs.items()
    }
    for kind, (s, m) in med.items():
        print(f"| {kind} | {s:.2f} | {m:.0f} |")
    print(
        f"| pagedkv / transformers | {med['pagedkv'][0] / med['transformers'][0]:.2f}x | "
        f"{med['pagedkv'][1] / med['transformers'][1]:.2f}x |"
    )


if __name__ == "__main__":
    main()
