# make book [PROFILE=smoke|cpu|full]   set up .venv and build the book (default: full with a GPU, else cpu)
# make test                            set up .venv and headless Chromium, run every test
PROFILE ?=
PYTEST_ARGS ?=

.PHONY: setup book test clean
setup:
	@bash scripts/setup.sh

book: setup
	.venv/bin/circuitbook build $(if $(PROFILE),--profile $(PROFILE),)

test: setup
	@bash scripts/setup-browser.sh
	.venv/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf _build
