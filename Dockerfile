# The worker image: `orchestrator worker` by default, `orchestrator migrate` for the Job.
#   docker build -t agent-orchestrator:0.1.0 .
# tini is PID 1 and forwards each signal once to orchestrator: a second SIGTERM would make the
# worker exit at once instead of draining (orchestrator/drain.py), so no `tini -g`.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml constraints.txt README.md LICENSE ./
COPY orchestrator ./orchestrator
COPY tasks ./tasks
COPY retry_config ./retry_config
COPY checkpoints ./checkpoints
# The pinned versions of ./dev and CI; no dev extras.
RUN pip install -c constraints.txt .

FROM python:3.11-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 orchestrator \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin orchestrator
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
USER 10001
EXPOSE 8080
ENTRYPOINT ["tini", "--", "orchestrator"]
CMD ["worker"]
