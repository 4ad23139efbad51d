# Everything a fresh machine needs goes through these targets; each creates the
# virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
# The CPU build sits on local disk here; on a GPU host pass e.g. TORCH_SPEC="torch>=2.9".
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test venv clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	HF_HUB_OFFLINE=1 $(BIN)/glmtune train recipes/tiny/sft_support_json.yaml --overwrite

test: venv
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --durations=15 tests

clean:
	rm -rf $(VENV)
