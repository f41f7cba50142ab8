# The two commands of the README: `make book` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
export PYTHONHASHSEED := 0
export OMP_NUM_THREADS := 2

.PHONY: book test unit slow notebooks lint format newest captures clean

$(VENV)/.ready: requirements-cpu.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

## the book: executes every notebook (CPU: interpreter and stored captures) and builds HTML
book: $(VENV)/.ready
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "open _build/html/index.html"

## every test: unit tests, nbval over every notebook, the book with -W, ruff
test: $(VENV)/.ready unit notebooks book lint

## the unit tests but the heavy interpreter cases (marked slow: the GPU run and
## `make slow` execute them; every kernel keeps its float64 tests here)
unit: $(VENV)/.ready
	$(BIN)/pytest -n 2 -q -m "not slow" tests

slow: $(VENV)/.ready
	$(BIN)/pytest -n 2 -q -m slow tests

notebooks: $(VENV)/.ready
	$(BIN)/pytest -q -n 2 --dist loadfile --nbval-lax --nbval-current-env \
	    --nbval-sanitize-with book/sanitize.cfg -p no:cacheprovider book

lint: $(VENV)/.ready
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## the unit tests with the newest torch and Triton the registry resolves (unpinned, in
## their own venv): the Gluon kernels, validated on Triton 3.6 only, fall back loudly
NEWEST ?= .venv-newest
newest:
	python3 -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	$(NEWEST)/bin/python -m pip install -q --upgrade torch triton numpy ase vesin \
	    vesin-torch matplotlib scipy e3nn pytest pytest-xdist
	$(NEWEST)/bin/python -m pip install -q --no-deps -e .
	$(NEWEST)/bin/python -c "import torch, triton; print('newest:', torch.__version__, triton.__version__)"
	$(NEWEST)/bin/pytest -n 2 -q -p no:cacheprovider -m "not slow" tests

format: $(VENV)/.ready
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf _build
