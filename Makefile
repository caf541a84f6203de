# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
.PHONY: setup demo test check lint typecheck docs unit pair nightly soak compat

VENV := .venv/bin
PYTEST := $(VENV)/python -m pytest

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/agentkv demo

# The landing check, fastest failure first: lint, types, the docs build, the unit tier (no engine),
# then the real-engine tier. Each step runs only when the ones before it passed. Tiers: docs/development.md.
test: setup check unit pair

check: lint typecheck docs

lint:
	$(VENV)/ruff check src tests examples
	$(VENV)/ruff format --check src tests examples

typecheck:
	$(VENV)/mypy

docs:
	$(VENV)/mkdocs build --strict --site-dir .site

# Tests that need no engine (3 minutes on 2 cores), one worker per core (at most 4): they share nothing but
# the model's cache, which is prepared under a file lock. The real-engine tier runs in one process.
unit: setup
	$(PYTEST) -m "not pair and not nightly" -n logical --maxprocesses=4

# Tests on real engines: the shared pair, colocated engine and launched pair, and the few that own theirs.
pair: setup
	$(PYTEST) -m "pair and not nightly"

# The long tier (not in `make test` or CI): long repeat counts, stock vLLM servers, network namespaces,
# the notebook in a Jupyter kernel, then the soak. Run it before resolving an issue that changes engines.
nightly: setup
	$(PYTEST) -m nightly
	$(VENV)/python scripts/soak.py

# The soak alone: 8 concurrent sessions x 20 turns on the real pair (minutes).
# Results and how to read them: docs/reliability.md.
soak: setup
	$(VENV)/python scripts/soak.py

# The compatibility tier (nightly, not in `make test`): each newer vLLM's CUDA wheel (0.33, 0.34) in a scratch
# environment outside the checkout ($AGENTKV_COMPAT_DIR, default /tmp/agentkv-compat; several GB each, kept for the
# next run), then the plugin load, every feature probe, the CUDA mapping tests, the connector's tests and the KV
# handle against vLLM's real code; no GPU needed. A machine whose pip caps torch below the wheel's pin needs the cap
# lifted first (here: rm -r /etc/xdg/pip). scripts/compat.py says more.
compat:
	python3 scripts/compat.py
