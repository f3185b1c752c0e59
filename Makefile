# make book                           set up .venv and render the book from published/ (_build/book/html)
# make book PROFILE=smoke|cpu|full     execute the book at a profile instead (_build/PROFILE/html)
# make test                            set up .venv and headless Chromium, run every test
# make check-site PROFILE=cpu          check a built book in headless Chromium, screenshots to _build/screenshots
# make lock                            pin .venv's packages into requirements.lock
# make device-pack                     the wheels a GPU machine without network needs, into .whl/ (scripts/device-run.sh)
# make book PROFILE=full NO_EXECUTE=1  render imported results (circuitbook import-results) without executing anything
# make publish PROFILE=cpu             this store's current results at PROFILE into published/ (then commit it)
PROFILE ?=
PYTEST_ARGS ?=
NO_EXECUTE ?=
# The leading_terms chapter reads TinyStories from a local file: the book's sample in ../shared unless set.
CIRCUITBOOK_TINYSTORIES ?= $(wildcard $(abspath ../shared/data/tinystories/tinystories_lower_4MB.txt))
export CIRCUITBOOK_TINYSTORIES

.PHONY: setup book test check-site device-pack clean lock publish
setup:
	@bash scripts/setup.sh

# Pin the environment of .venv into requirements.lock (after adding or upgrading a package; commit it):
# its hash is part of every notebook's inputs, so results of another environment read `stale`.
lock:
	@bash scripts/lock.sh

book: setup
	.venv/bin/circuitbook build $(if $(PROFILE),--profile $(PROFILE),) $(if $(NO_EXECUTE),--no-execute,)

test: setup
	@bash scripts/setup-browser.sh
	.venv/bin/python -m pytest $(PYTEST_ARGS)

check-site:
	@bash scripts/setup-browser.sh
	.venv/bin/python scripts/check_site.py _build/$(or $(PROFILE),cpu)/html

publish: setup
	.venv/bin/circuitbook publish --profile $(or $(PROFILE),cpu)

device-pack: setup
	.venv/bin/python scripts/device_pack.py

clean:
	rm -rf _build
