# Everything a fresh machine needs goes through these targets; each creates the
# virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
# The CPU build sits on local disk here; on a GPU host pass e.g. TORCH_SPEC="torch>=2.9".
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo distill test test-fast test-capability test-engines venv chromium clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

venv: $(BIN)/.installed

DEMO_RUN := runs/tiny-sft-support-json

# Train, evaluate the result against the model it started from (the bundled suite's release
# gates decide), write the release manifest and check it against the files.
demo: venv
	HF_HUB_OFFLINE=1 $(BIN)/glmtune train recipes/tiny/sft_support_json.yaml --overwrite
	HF_HUB_OFFLINE=1 $(BIN)/glmtune eval recipes/tiny/eval_support_json.yaml --base $(DEMO_RUN) \
	    --candidate $(DEMO_RUN) --overwrite
	HF_HUB_OFFLINE=1 $(BIN)/glmtune release $(DEMO_RUN) --eval $(DEMO_RUN)/eval/support-json \
	    --engine transformers==$$($(BIN)/python -c 'import transformers; print(transformers.__version__)') --overwrite
	HF_HUB_OFFLINE=1 $(BIN)/glmtune release verify $(DEMO_RUN)/release.json

# The HTML scorecard's browser test drives Debian's chromium through Playwright (never a
# browser Playwright downloads); installed here when missing, as root (CI, a fresh machine).
# Elsewhere than Linux the test skips and nothing is installed.
chromium:
	@if [ "$$(uname -s)" = Linux ] && ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	    echo "make test: the HTML report's browser test needs chromium on PATH; install it as root (Debian: apt-get install -y chromium), then run make test again" >&2; \
	    exit 1; \
	  fi; \
	  echo "installing Debian's chromium (the HTML report's browser test)"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	fi

test: venv chromium
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --durations=60 --ignore=tests/engines \
	    --ignore=tests/distill/test_distill_demo.py tests

# The edit-test loop: every test that starts no other process. tests/conftest.py marks the others at
# collection (multiprocess: gloo jobs of several ranks; subprocess: glmtune in another interpreter,
# training runs, the browser; slow: in-process tests of more than ~10 s); no chromium needed.
test-fast: venv
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --durations=25 \
	    -m "not multiprocess and not subprocess and not slow" --ignore=tests/engines tests

# The multi-process layout tests (every layout against one process) and the golden losses again, on
# the CPU's next-narrower vector kernels (avx512 -> avx2 -> default): their tolerances come from the
# arithmetic, and a user's CPU is not this one (tests/distributed/layout_tolerances.py). CI runs it.
# With them, the long end-to-end run `make test` leaves out: the tiny distillation demo (~10 minutes,
# tests/distill/test_distill_demo.py), whose claim must hold on these kernels too.
test-capability: venv
	cap=$$($(BIN)/python -c 'import torch; print({"AVX512": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "default"))'); \
	echo "layout tests under ATEN_CPU_CAPABILITY=$$cap"; \
	HF_HUB_OFFLINE=1 ATEN_CPU_CAPABILITY=$$cap $(BIN)/python -m pytest -q -n 2 tests/distributed tests/test_golden_losses.py \
	    tests/distill/test_distill_demo.py

# Opt-in: vLLM's and SGLang's own LoRA loader code on our adapters, in a separate venv (~2 GB,
# --no-deps engines, CPU torch); compares with tests/peft/engine_fixtures/ (docs/lora.md).
ENGINES_VENV ?= /tmp/glmtune-engines
test-engines: venv
	bash scripts/engines_venv.sh $(ENGINES_VENV)
	HF_HUB_OFFLINE=1 GLMTUNE_PYTHON=$(abspath $(BIN))/python $(ENGINES_VENV)/bin/python -m pytest -q tests/engines

# Distillation, the whole tiny flow on a CPU (docs/distill.md, "The tiny demo"; the steps and why are
# in the script, which tests/distill/test_distill_demo.py runs too): the SFT demo's model (trained
# first when runs/ lacks it) as the in-process teacher, 1000 tickets answered with top-8
# log-probabilities, a 3-layer student, one scorecard on 240 tickets of another seed (base student ->
# distilled student, whose gate decides the target's status, the teacher a --compare arm beside them).
distill: venv
	bash scripts/distill_demo.sh $(BIN)

clean:
	rm -rf $(VENV)
