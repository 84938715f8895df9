#!/usr/bin/env bash
# The environment the vLLM-Omni tests run in (issue 49: pagedkv's manager beside vLLM-Omni's own
# DiffusionKVCacheManager in its real RequestScheduler): vLLM's (.ci/vllm_env.sh: the CPU torch that lies on disk, the
# pinned packages vLLM's v1 scheduler needs, pagedkv with its test extras), with vLLM 0.30.0 (the vLLM that vLLM-Omni
# 0.30.0 is built against: it does not import with vLLM 0.33) and vLLM-Omni 0.30.0, both without their dependency trees
# (which would pull a CUDA torch), and the pinned packages vLLM-Omni's diffusion scheduler, KV manager and worker
# backend need to import (.ci/vllm-omni-requirements.txt). Given an environment .ci/vllm_env.sh built (CI's, after
# its vLLM tests), it installs the two over it (pip replaces that vLLM) instead of building another.
# usage: .ci/vllm_omni_env.sh VENV_DIR
set -euo pipefail
VENV="${1:?give the venv directory}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ -x "$VENV/bin/python" ] || "$HERE/vllm_env.sh" "$VENV" 0.30.0
"$VENV/bin/pip" install -q --no-deps vllm==0.30.0 vllm-omni==0.30.0
"$VENV/bin/pip" install -q --no-deps -r "$HERE/vllm-omni-requirements.txt"
"$VENV/bin/python" -c "import torch, vllm, vllm_omni.diffusion.diffusion_kv.manager, \
vllm_omni.diffusion.sched.request_scheduler, vllm_omni.diffusion.diffusion_kv.model_runner_backend; \
assert not torch.version.cuda; print('vLLM', vllm.__version__, 'vLLM-Omni 0.30.0, torch', torch.__version__)"
