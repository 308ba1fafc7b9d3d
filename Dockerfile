# One image for the api, the GPU worker, the beat and the one-shot migrate.
# Base on a CUDA runtime so the worker finds the GPU; the api and beat never touch it.
FROM nvidia/cuda:12.4.1-runtime-ubuntu22.04
# gcc and the Python headers: Triton compiles its kernel launchers at first use, and the CPU path
# builds its C decode attention (batchapi/kernels/cpu/build.py) the same way
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
        python3-pip gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY batchapi ./batchapi
COPY migrations ./migrations
COPY alembic.ini ./
RUN python3.11 -m pip install --no-cache-dir .
ENV BATCHAPI_DATA_DIR=/data BATCHAPI_MODEL_CACHE=/models
ENTRYPOINT ["batchapi"]
