# Two entry points do all the set-up on a fresh machine:
#   make serve   -- serve the default model on http://127.0.0.1:8000 (OpenAI API)
#   make test    -- install what the tests run (as root), then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Ray 2.60 binds to the machine's external address unless told otherwise; keep it on loopback.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0

.PHONY: setup test test-deps check-wheel serve generate lint k8s clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[test,bench,dev]'
	touch $(STAMP)

# mypy --strict first, on all three packages (config: [tool.mypy] in pyproject.toml).
test: test-deps setup
	$(PY) -m mypy engine kernels serve_app
	$(PY) -m pytest -q -ra tests

# The programs the tests run (prometheus, a C compiler): apt-get installs them as root, else
# one line says what to install.
test-deps:
	@bash scripts/install_test_deps.sh

# The package as users install it: wheel -> fresh venv -> the app starts from it (CI runs this).
check-wheel:
	bash scripts/check_wheel.sh

serve: setup
	$(VENV)/bin/pagedserve serve

generate: setup
	$(VENV)/bin/pagedserve generate --prompt "Hello, my name is" --max-tokens 32

k8s: setup
	$(PY) scripts/render_k8s.py

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
