# Each target sets up ./.venv itself (Python 3.11, pinned versions in constraints.txt).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.raydcp-installed

.PHONY: demo test lint typecheck api-docs bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,bench,docs]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) jobs/demo.py
	$(PY) jobs/train_elastic.py --verify

# Three pytest processes side by side (most of the suite waits on Ray's processes, not the CPU):
# the tests that use the session's local Ray instance (marker `ray`, added by tests/conftest.py to
# every test that uses it), the tests that need no Ray, and the multi-node tests (marker `cluster`),
# which start a Ray cluster of their own that one process cannot hold beside a local instance.
# The first runs in the foreground; the others' output follows it. The tests that need no Ray have
# time to spare: they yield the CPU (nice) to the longest, those of the session's Ray.
test: $(STAMP)
	@$(PY) -m pytest -q -p no:cacheprovider -m cluster tests/cluster --durations=5 > $(VENV)/cluster-tests.log 2>&1 & \
	cluster=$$!; \
	nice -n 10 $(PY) -m pytest -q -p no:cacheprovider -m "not cluster and not ray" --durations=5 > $(VENV)/plain-tests.log 2>&1 & \
	plain=$$!; trap 'kill $$cluster $$plain 2>/dev/null' INT TERM; \
	echo "$(PY) -m pytest -q -m cluster tests/cluster  (in the background: $(VENV)/cluster-tests.log)"; \
	echo "$(PY) -m pytest -q -m \"not cluster and not ray\"  (in the background: $(VENV)/plain-tests.log)"; \
	echo "$(PY) -m pytest -q -m \"ray and not cluster\""; \
	$(PY) -m pytest -q -m "ray and not cluster" --durations=15; main=$$?; \
	wait $$plain; plain_rc=$$?; wait $$cluster; multi=$$?; \
	echo "--- the tests that need no Ray, run beside the above:"; cat $(VENV)/plain-tests.log; \
	echo "--- the multi-node cluster tests (tests/cluster), run beside the above:"; cat $(VENV)/cluster-tests.log; \
	test $$main -eq 0 && test $$plain_rc -eq 0 && test $$multi -eq 0

lint: $(STAMP)
	$(VENV)/bin/ruff check raydcp tests bench jobs

# The public modules (pyproject's [tool.mypy] files); tests/test_typing.py runs the same check.
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The API reference, from the docstrings, into build/api/index.html (the packages' lazy names resolved first).
api-docs: $(STAMP)
	$(PY) -c "import pdoc.__main__, raydcp, raydcp.pipeline as p; [getattr(m, n) for m in (raydcp, p) for n in m.__all__]; \
	pdoc.__main__.cli(['-o', 'build/api', 'raydcp', 'raydcp.train', 'raydcp.pipeline', 'raydcp.options', 'raydcp.errors'])"
	@echo "API reference: build/api/index.html"

bench: $(STAMP)
	$(PY) bench/single_process.py
	$(PY) bench/planning.py
	$(PY) bench/async_save.py

clean:
	rm -rf $(VENV) build *.egg-info
