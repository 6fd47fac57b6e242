# vLLM integration tests in their own venv, so the system Python never gets vLLM
# (its wheel pins a CUDA torch, several GB). The venv sees the system's torch
# (--system-site-packages; 2.13 CPU here): vLLM's Python modules that kvoffload.vllm
# uses import with it, and its compiled ops are never loaded.
VENV := .venv-vllm
PY := $(VENV)/bin/python
VLLM_VERSION := 0.33.0
# What `import vllm...simple_cpu_offload_connector` needs, found by importing it;
# bounds from vLLM 0.33.0's own requirements where it pins one.
VLLM_IMPORT_DEPS := psutil pyzmq "transformers>=5.16.1,<5.21.0" cbor2 aiohttp openai-harmony \
	openai pybase64 cachetools msgspec uvloop prometheus_client "xgrammar==0.2.8" fastapi \
	partial_json_parser llguidance

.PHONY: vllm-env test-vllm

vllm-env: $(VENV)/.done

$(VENV)/.done:
	python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install --no-deps vllm==$(VLLM_VERSION)
	$(PY) -m pip install $(VLLM_IMPORT_DEPS)
	$(PY) -m pip install --no-deps -e .
	$(PY) -c "import vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector"
	touch $@

test-vllm: vllm-env
	$(PY) -m pytest -m vllm tests/test_vllm_connector.py -q -p no:cacheprovider
