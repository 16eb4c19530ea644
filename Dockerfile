# kvgate: a slim, non-root image running `kvgate serve`.
#   docker build -t kvgate .
#   docker run -p 8000:8000 -v $PWD/policy.yaml:/etc/kvgate/policy.yaml kvgate
# The policy file lists the engine replicas (url, kv_events, kv_replay): docs/configuration.md.
# Only the gateway's folders are copied, so the wheel built here has no simulated fleet, load generator or
# benchmarks (setup.py packages the folders present) and no dependency of theirs (they are extras).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY router ./router
COPY cache_index ./cache_index
COPY policies ./policies
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
