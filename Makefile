# The two quickstart commands:
#   make run    sets up a virtual environment, builds the native core, runs the default model
#   make test   sets up the same, fetches the real models, runs lint and every test but the slow ones
#   make test-slow   the slow ones (the reference engine over the whole perplexity corpus, ...)
VENV ?= .venv
PY := $(VENV)/bin/python
# the default model is an instruct model: `run` asks it, so the prompt is a question
PROMPT ?= What is the capital of France?

.PHONY: setup build run test test-slow test-asan lint bench clean browser

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e ".[test,server,chat,ray,structured,hub]"
	touch $@

# The C core is rebuilt in place only when a C source, a header or setup.py changed since the last build
# (the stamp's time), or when no built core is there: a second `make run` starts at once instead of
# spending 40 s compiling. A rebuild compiles every object: setuptools would reuse objects whose headers
# changed. `build` also compiles the package's bytecode (only what changed): a start then reads barellm's
# modules compiled, as from an installed wheel, even where PYTHONDONTWRITEBYTECODE=1 keeps Python from
# writing it (compiling them is +0.2 s a start).
NATIVE_SOURCES := $(shell find src/barellm/_native -name '*.c' -o -name '*.h') setup.py
NATIVE_STAMP := build/.native-core
ifeq ($(wildcard src/barellm/_native*.so),)
.PHONY: $(NATIVE_STAMP)
endif

build: setup $(NATIVE_STAMP)
	$(PY) -m compileall -q src/barellm

$(NATIVE_STAMP): $(NATIVE_SOURCES) $(VENV)/.installed
	$(PY) setup.py -q build_ext --inplace --force
	@mkdir -p $(dir $@) && touch $@

run: build
	$(VENV)/bin/barellm run "$(PROMPT)" --max-tokens 64 --temperature 0 --verbose

lint: setup
	$(VENV)/bin/ruff check .

test: build lint browser
	$(VENV)/bin/barellm pull --keep-gguf smollm2-135m gemma3-270m qwen2.5-coder-0.5b
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"
	$(MAKE) test-asan

# The web page test drives Debian's chromium through chromedriver. Installed here when missing and we may
# (root with apt-get, as on CI); elsewhere the test is skipped unless CI requires it.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium and chromium-driver for the web page test"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "note: chromium/chromedriver missing: the web page test will be skipped (apt-get install chromium chromium-driver)"; fi

test-slow: build
	$(VENV)/bin/barellm pull --keep-gguf smollm2-135m gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
	$(PY) -m pytest -q -p no:cacheprovider -m slow

# The kernel tests again, against a copy of the native core built with AddressSanitizer.
test-asan: setup
	rm -rf .asan-build
	BARELLM_SANITIZE=1 $(PY) setup.py -q build_ext -b .asan-build/lib -t .asan-build/tmp
	cp -r src/barellm .asan-build/pkg && rm -f .asan-build/pkg/_native*.so
	cp .asan-build/lib/barellm/_native*.so .asan-build/pkg/
	mkdir -p .asan-build/path && mv .asan-build/pkg .asan-build/path/barellm
	cd .asan-build && PYTHONMALLOC=malloc LD_PRELOAD=$$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
		PYTHONPATH=$$PWD/path $(abspath $(PY)) -m pytest -q -p no:cacheprovider --rootdir=.. -c ../pyproject.toml \
		$$(ls ../tests/test_kernels*.py ../tests/test_ops.py 2>/dev/null)

bench: build
	$(VENV)/bin/barellm bench

clean:
	rm -rf build .asan-build src/barellm/_native*.so
