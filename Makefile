# The two commands a newcomer needs (see README.md).
PYTHON ?= python3

.PHONY: install install-vllm test test-fast test-vllm integration bench protos lint

install:            ## both distributions (kvcoord-client, kvcoord) editable + test deps + Debian packages for the container tests
	./scripts/install.sh

install-vllm:       ## only the cached vLLM 0.16.0 and 0.33.0 venvs for tests/with_vllm
	./scripts/install_vllm.sh
	KVCOORD_VLLM_VERSION=0.33.0 ./scripts/install_vllm.sh

test:               ## everything: fast suites (in parallel, pytest-xdist), then the Docker image + Prometheus integration suite
	./scripts/test.sh

test-fast:          ## everything except the container suite (in parallel: see scripts/test.sh)
	./scripts/test.sh --fast

test-vllm:          ## only vLLM's real schedulers on kvcoord (in the vLLM 0.16.0 and 0.33.0 venvs)
	./scripts/test_vllm.sh
	KVCOORD_VLLM_VERSION=0.33.0 ./scripts/test_vllm.sh

integration:        ## only the container suite (builds and starts the image)
	./scripts/test.sh --integration-only

bench:             ## engine scaling, wire costs, memory (bench/vs_vllm.py needs vLLM: see its docstring)
	$(PYTHON) bench/engine.py
	$(PYTHON) bench/step.py
	$(PYTHON) bench/stall.py
	$(PYTHON) bench/memory.py

protos:             ## regenerate client/kvcoord/v1 after editing proto/
	$(PYTHON) scripts/gen_protos.py

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .
