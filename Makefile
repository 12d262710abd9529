# The two quickstart commands:
#   make run    sets up a virtual environment, builds the native core, runs the default model
#   make test   sets up the same, fetches the real models, runs lint and every test but the slow ones
#   make test-slow   the slow ones (the reference engine over the whole perplexity corpus, ...)
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= The capital of France is

.PHONY: setup build run test test-slow test-asan lint bench clean browser

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e ".[test,server,chat,ray,structured,hub]"
	touch $@

# rebuilds the C core in place, every object (setuptools would reuse objects whose headers changed), and
# compiles the package's bytecode: a start then reads barellm's modules compiled, as from an installed wheel,
# even where PYTHONDONTWRITEBYTECODE=1 keeps Python from writing it (compiling them is +0.2 s a start)
build: setup
	$(PY) setup.py -q build_ext --inplace --force
	$(PY) -m compileall -q src/barellm

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
