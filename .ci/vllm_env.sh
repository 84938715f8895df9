#!/usr/bin/env bash
# The second environment CI runs the vLLM tests in (tests/integrations: the lockstep differential against vLLM's
# own KV cache manager, the fuzzed configurations, the event streams): the CPU torch that lies on disk, vLLM's
# wheel without its dependency tree (which would pull a CUDA torch), the pinned packages its v1 scheduler needs
# (.ci/vllm-requirements.txt), then pagedkv itself with its test extras.
# usage: .ci/vllm_env.sh VENV_DIR [VLLM_VERSION]   (0.33.0 by default; 0.34.0 the other supported release)
set -euo pipefail
VENV="${1:?give the venv directory}"
VERSION="${2:-0.33.0}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q --no-deps "vllm==$VERSION"
"$VENV/bin/pip" install -q -r "$HERE/vllm-requirements.txt"
"$VENV/bin/pip" install -q -e "$HERE/..[test]"
"$VENV/bin/python" -c "import torch, vllm, vllm.v1.core.kv_cache_manager; assert not torch.version.cuda; \
print('vLLM', vllm.__version__, 'torch', torch.__version__)"
