# kvgate: a slim, non-root image running `kvgate serve`.
#   docker build -t kvgate .
#   docker run -p 8000:8000 -v $PWD/policy.yaml:/etc/kvgate/policy.yaml kvgate
# The policy file lists the engine replicas (url, kv_events, kv_replay) — see README "Policy file".
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
COPY cache_index ./cache_index
COPY policies ./policies
COPY loadgen ./loadgen
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home /nonexistent --shell /usr/sbin/nologin kvgate
COPY --from=build /install /usr/local
USER 10001
EXPOSE 8000
# /health is liveness; /ready says at least one replica is routable.
HEALTHCHECK --interval=10s --timeout=2s CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health').status != 200)"
ENTRYPOINT ["kvgate", "serve"]
CMD ["--config", "/etc/kvgate/policy.yaml", "--host", "0.0.0.0", "--port", "8000"]
