# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
.PHONY: setup demo test check lint typecheck docs unit soak

VENV := .venv/bin

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/agentkv demo

# Lint, types, docs, then every test (the real-pair tests included).
test: setup check
	@$(VENV)/python -m pytest; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

check: lint typecheck docs

lint:
	$(VENV)/ruff check src tests examples
	$(VENV)/ruff format --check src tests examples

typecheck:
	$(VENV)/mypy

docs:
	$(VENV)/mkdocs build --strict --site-dir .site

# Tests that need no engine (seconds).
unit: setup
	$(VENV)/python -m pytest -m "not pair"

# The soak: 8 concurrent sessions x 20 turns on the real pair (minutes; not in `make test` or CI).
# Results and how to read them: docs/reliability.md.
soak: setup
	$(VENV)/python scripts/soak.py
